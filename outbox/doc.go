// Package outbox is settle's transactional outbox: messages are written to a
// table in the same database transaction as the state change that caused
// them, and forwarded to the broker after that transaction commits.
//
// Each row carries its own forwarded mark. A [Relay] claims committed rows
// that are not marked (FOR UPDATE SKIP LOCKED on PostgreSQL and MySQL; SQLite
// has one writer), publishes them and commits their marks, so no committed
// row can be passed over, whatever order concurrent transactions commit in.
// It wakes on commit (PostgreSQL LISTEN/NOTIFY, [Outbox.Notify] in this
// process) and polls only as a fallback. The NOTIFY is queued by the
// writer's INSERT, or, with [Config.NotifyAfterCommit], sent after the
// commit by a [Notifier], which leaves the writers' commits unserialised. Every function takes the
// application's *sql.DB; on PostgreSQL, an application on pgx uses its
// pgx.Tx and *pgxpool.Pool instead ([Outbox.PgxTxPublisher],
// [Outbox.NewPgxRelay] and the other Pgx functions), with the same
// statements underneath.
//
// # What it does not guarantee
//
//   - Exactly-once delivery: a relay that dies between publishing a batch and
//     committing its marks publishes those rows again. Consumers dedupe.
//   - Order across transactions, or any order with several relays; see
//     docs/outbox.md for the order that is kept.
//
// [SQLiteSchema] and [SQLiteOffsetsAdapter] are a separate piece: they let
// watermill-sql publish to and subscribe from SQLite (modernc.org/sqlite).
package outbox
