// Package parked is the parked-message store: a table in the application's
// own database (PostgreSQL, MySQL/MariaDB or SQLite, on any sqldb.Driver)
// where the parking middlewares record every message they dead-letter or
// poison, before its original is acked. Operators find failures there by
// handler, topic, outcome, failure group, reason, UUID, key or time window;
// see them grouped by cause; replay one, a selection or a whole group
// exactly once through the transactional outbox; archive what will never be
// replayed; and prune what is old.
//
// A Store is a settle.ParkStore: set it as middleware.ParkConfig.Store (or
// pipeline.Config.ParkStore), beside the parking topic or instead of it.
//
// The library never creates the tables: Schema returns their DDL and Check
// says at start-up whether they are there and as settle needs them.
//
// # Failure groups
//
// Each row belongs to a failure group: its handler, the type of the error
// that parked it, and the error's text with ids and numbers normalised
// (UUIDs, hex strings, numbers and quoted values replaced by placeholders),
// so that one bug is one group however many messages it parked. Counts per
// group are kept in a table of their own, in the transaction that changes a
// row, so Groups answers without scanning the parked rows.
//
// # Replay
//
// Replay writes a copy of each selected message through an outbox.Outbox of
// the same database, in the transaction that marks its row replayed: a
// replay interrupted, run twice or run by two operators at once publishes
// each message once. The copy is the original message (payload and
// metadata) with the replay keys of package settle (settle_replay_count,
// settle_replayed_at, settle_replay_of, ...) and a UUID derived from the
// original's and the replay count, the same for the same replay, so the
// dedupe middleware runs the handler once per replay. A message replayed
// MaxReplays times that failed again is refused unless the replay is forced
// (the loop guard).
//
// # What it does not guarantee
//
// A row records the message as the parking middleware saw it; metadata
// forged by a producer is recorded as sent. Reason searches are substring
// scans within the other filters: give a handler, group or time window at
// volume.
package parked
