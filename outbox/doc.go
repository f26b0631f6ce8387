// Package outbox is settle's transactional outbox: messages are written to a
// table in the same database transaction as the state change that caused
// them, and forwarded to the broker after that transaction commits.
//
// [SQLiteSchema] and [SQLiteOffsetsAdapter] let watermill-sql publish to and
// subscribe from SQLite (modernc.org/sqlite), so the outbox works on the
// embedded default as it does on PostgreSQL and MySQL.
package outbox
