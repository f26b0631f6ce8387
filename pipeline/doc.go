// Package pipeline assembles settle's pieces for a Watermill router.
//
// There are eight ways to add a handler, one per need:
//
//	Pipeline.Handle           a plain handler (Typed decodes the payload first)
//	Pipeline.HandleProducing  a handler whose returned messages are published
//	HandleTx                  a handler in a database transaction (TypedTx decodes first)
//	HandleBatchTx             a handler of a batch of deliveries in one transaction
//	NewTxHandler, NewBatchTxHandler  the same two, for a router assembled by hand
//
// NewTxHandler runs a handler in a database transaction that also confirms
// the message's dedupe key and holds the messages it publishes through the
// transactional outbox: consume, transform and produce, once.
// NewBatchTxHandler runs a handler once for a batch of deliveries, in one
// transaction with all their keys and outbox messages.
//
// The transactional handlers are generic over the transaction type of
// their database's driver, named once in TxConfig.DB: sqldb.Std(db,
// dialect) hands the function a *sql.Tx, sqldb.Pgx(pool) a pgx.Tx. The
// dedupe store and the outbox are of the same driver
// (*dedupe.SQLStore[TTx], *outbox.Outbox[TTx]). Every driver runs the one
// transactional flow of this package, group commit (BatchConfig) included.
//
// Every call settle makes on the database for a delivery has a deadline
// (TxConfig.CallTimeout, which Pipeline sets from Config.StoreTimeout, half
// the claim timeout): a database that does not answer, as behind a silent
// network partition, has the transaction rolled back and the delivery
// deferred within that bound instead of held, and settle's PostgreSQL
// transactions set their own lock and idle-in-transaction timeouts so that
// a vanished client's locks do not hold the other consumers for long. What
// MySQL and MariaDB need in the DSN instead is in docs/operating.md. The
// handler's own function has that deadline too where no claim is renewed
// (OneStatement, batches), and running past it is the handler's failure, an
// attempt.
//
// A transaction that loses its connection (ErrConnectionLost: the server
// ended the session, the connection was reset or closed) is no message's
// failure: it is run again on a new connection, after BusyDelay, up to three
// times, and then its deliveries are deferred, no attempt spent.
package pipeline
