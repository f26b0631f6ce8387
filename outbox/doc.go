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
// commit by a [Notifier], which leaves the writers' commits unserialised.
//
// An outbox is made on the database it lives in, through package sqldb:
//
//	ob, err := outbox.New(sqldb.Std(db, sqldb.Postgres), outbox.Config{}) // *Outbox[*sql.Tx]
//	ob, err := outbox.New(sqldb.Pgx(pool), outbox.Config{})               // *Outbox[pgx.Tx]
//
// Every method then runs on that database, with one set of statements per
// dialect whatever the driver, and [Outbox.TxPublisher] takes the driver's
// transaction (*sql.Tx or pgx.Tx). The [Relay] and the [Notifier] start
// their goroutines only in Run, and those end when Run returns.
//
// A row the broker refuses (a destination refused for good, a message
// larger than it takes) holds no other row: the relay counts the failure
// on that row, retries it after a backoff while it forwards the rows behind
// it, and after [RelayConfig.MaxAttempts] sets it aside, where [Outbox.Status],
// [Outbox.Failed] and `settle outbox status` show it, until [Outbox.Requeue]
// (`settle outbox retry`) puts it back. A row whose publish does not return
// within [RelayConfig.AckDeadline] is handled the same way: its batch is
// rolled back, its failure counted, and the next batch passes over it and
// publishes the rows behind it. A broker outage sets nothing aside.
// A row is marked forwarded once the relay's publisher returned nil: on
// RabbitMQ, relay through amqpsub.Publisher, which also fails a row the
// broker routed to no queue (the row is then retried and set aside like
// any refused row). A watermill-amqp Publisher without publisher confirms is
// refused ([ErrUnconfirmedPublisher]); one with them is accepted with an
// error logged, since it reports a row routed nowhere as published.
// Batches are bounded in rows and in bytes. A table of the earlier shape,
// without the per-row failure columns, is brought to this one by the
// statements of [Outbox.SchemaUpgrade] (`settle outbox schema -upgrade`).
//
// # What it does not guarantee
//
//   - Exactly-once delivery: a relay that dies between publishing a batch and
//     committing its marks publishes those rows again. Consumers dedupe.
//   - Order across transactions, or any order with several relays, or the
//     order of a transaction's messages once one of them failed to publish
//     (it is retried after the ones behind it); see docs/outbox.md for the
//     order that is kept.
//   - That a failing row is set aside when nothing else is published: it
//     is set aside only once the broker took some other row after its first
//     failure, or a row to another topic after its topic began to fail, so
//     that an outage sets nothing aside; until then it is retried, and
//     Status shows it.
//   - That a row routed to no queue is seen through a publisher that does
//     not report it: watermill-amqp's Publisher marks it forwarded, and a
//     publisher wrapped in a type of your own is not looked into.
//
// The outbox does not use watermill-sql's Publisher or Subscriber; to run
// those on SQLite, see package sqlitepubsub.
package outbox
