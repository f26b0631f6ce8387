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
// Park returns nil only once the row is committed; an error from it defers
// the delivery.
//
// The library never creates the tables: Schema returns their DDL and Check
// says at start-up whether they are there and as settle needs them. The
// rows table (Config.Table, "settle_parked" by default) holds one row per
// handler and message, the whole message (payload and metadata, any bytes
// and any size the database takes) with its failure and its state; the
// groups table (Config.Table + "_groups") holds the counts of each failure
// group. Times are stored as Unix microseconds from the clock of the
// process that wrote them, so every database compares and orders them
// alike.
//
// # Failure groups
//
// Each row belongs to a failure group: its handler, its outcome, the Go
// type of the innermost error that parked it (errors.Unwrap followed to
// the end; of errors.Join, the first error's), and the error's text with
// ids and values normalised (quoted strings, URLs, timestamps, UUIDs,
// network and e-mail addresses, durations, hex ids and numbers replaced by
// placeholders such as <n> and <q>), so that "order 17 failed" and "order
// 18 failed" are one group. The group's id is a short hash of the four.
// Counts per group are kept in the groups table, in the transaction that
// changes a row, so Groups answers without scanning the parked rows.
//
// # Replay
//
// Replay writes a copy of each selected message through an outbox.Outbox of
// the same database, in the transaction that marks its row replayed: a
// replay interrupted, run twice or run by two operators at once publishes
// each message once. Rows are claimed by an UPDATE that writes a token of
// the transaction's own, only on rows still parked, and the copies are
// written for the rows that carry the token: what the statement wrote
// decides, never a count of affected rows. The copy is the original
// message (payload and metadata, less settle's failure keys) with the
// replay keys of package settle (settle_replay_count, settle_replayed_at,
// settle_replay_of, settle_replay_outcome, settle_replay_reason,
// settle_replayed_by) and a UUID derived from the original's and the
// replay count, the same for the same replay, so the dedupe middleware runs
// the handler once per replay. A copy that fails again is parked in a row of
// its own, which starts at the copy's replay count: a message replayed
// MaxReplays times that failed again is refused unless the replay is forced
// (the loop guard).
//
// # What it does not guarantee
//
//   - A row records the message as the parking middleware saw it; metadata
//     forged by a producer is recorded as sent (a forged
//     settle_replay_count makes the loop guard refuse the message sooner).
//   - Reason searches are substring scans within the other filters: give a
//     handler, group or time window at volume.
//   - Text columns hold valid UTF-8: invalid bytes and NUL in a handler,
//     topic, reason or name read back as U+FFFD (the UUID, key, payload
//     and metadata read back exactly). Handler and topic are kept to 600
//     characters, the reason to 16 KiB.
//   - A page of List does not move when rows are parked meanwhile, but a
//     row parked again (its last failure moved) may show in two pages, or
//     in none.
//   - Prune's cutoff and the times of replays and archiving are read from
//     the clock of the process that acts: keep clocks in sync.
package parked
