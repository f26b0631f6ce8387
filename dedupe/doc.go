// Package dedupe makes a handler's work happen once per message key, however
// often the broker delivers the message.
//
// Brokers deliver at least once: after a crash, a timeout or a nack the same
// message comes again. dedupe remembers, per key, whether the work was done.
// Unlike a "seen" set, it only records a key as done after the handler
// succeeded: a key is first claimed, then confirmed on success or released on
// failure, so a failed delivery's redelivery still does the work.
//
// # Claims
//
// A key is absent, claimed (by one owner, until an expiry) or confirmed:
//
//	absent --Claim--> claimed --Confirm--> confirmed
//	           ^          |
//	           +-Release--+  (or the claim expires)
//
// [Store.Claim] answers [Acquired] (the caller owns the key now), [Duplicate]
// (already confirmed) or [Busy] (another owner's claim is live). Each
// acquisition gets a fresh token, and Confirm, Release and Renew act only on
// the caller's own claim: a worker that stalled past its claim's expiry, whose
// key was taken over, gets [ErrClaimLost] instead of overwriting the new
// owner. Every acquisition increments the key's attempt count, which survives
// Release and crashes; the retry middleware uses it to stop a message that
// kills its consumer every time.
//
// # Middleware
//
// [NewMiddleware] wraps a Watermill handler: it claims the message's key
// (the UUID by default, or any [KeyFunc]) in the scope of the handler (two
// handlers of one message each do their work once; see [ScopeFunc]), runs
// the handler while renewing the claim, and confirms or releases. A duplicate is acked without running the
// handler; a busy key returns [ErrBusy] so that the broker redelivers the
// message later. A replayed copy addressed to another handler
// (settle.MetaReplayHandler names a handler other than this one, its "#N"
// suffix dropped, whatever the scope) is acked as a duplicate too, without a
// claim. It is a plain message.HandlerMiddleware and can be added to
// any router. A handler that returns messages needs [Config.Publisher], which
// publishes them before the key is confirmed; without it the delivery fails
// permanently ([ErrOutputWithoutPublisher]), never in a redelivery loop.
//
// Every call to the store has a deadline ([Config.StoreTimeout] for claims,
// renewals and the claim's hold and confirmation in a transaction;
// [Config.SettleTimeout] for Confirm and Release): a store that does not
// answer, as behind a silent network partition, defers the delivery within
// that bound.
//
// When the handler succeeded and the store cannot take the confirmation
// (the database restarting, the claims table renamed), the middleware holds
// the delivery and tries Confirm again, after pauses growing to a second,
// until the store answers: nacked, the delivery would come back once the
// claim had expired and run the handler a second time. It gives up only when
// the claim is no longer its own or the message's context ends.
//
// # Stores
//
// [MemoryStore] is per-process. [SQLStore] keeps claims in a table of
// PostgreSQL, MySQL/MariaDB or SQLite shared by all workers, on the
// [sqldb.Driver] the service opened its database with (sqldb.Std for
// database/sql, sqldb.Pgx for a pgx pool): one store, one API, whatever the
// driver. Create the table with the statements of [SQLStore.Schema] in your
// migrations (nothing is created on start-up). A SQLStore bound to a
// transaction ([SQLStore.WithTx], [ConfirmTx]) puts the claim or its
// confirmation in that transaction, so the handler's own writes and the
// confirmation commit together, and a rollback leaves no trace: the effect
// happens exactly once for everything in that database. Whatever the
// transaction's isolation level, no read that decides who owns a key answers
// from its snapshot: a worker whose claim was taken over after its
// transaction began gets [ErrClaimLost], or its transaction is aborted over
// the conflict (a serialization failure), never a confirmation.
//
// For tables of many millions of keys, [SQLConfig.Partition] makes the
// claims table partitioned by time on PostgreSQL and MySQL/MariaDB: Prune
// drops whole partitions instead of deleting rows, and each claim locks the
// key and looks for it in every partition, so that a key is still claimed
// once across partitions: in a transaction of its own, or in the caller's
// (at READ COMMITTED on PostgreSQL, at any level on MySQL/MariaDB).
//
// # What it does not guarantee
//
// Outside a transaction, a handler whose effect is outside the database (an
// e-mail, an HTTP call) can still run twice: if the process dies after the
// effect but before Confirm, the claim expires and a redelivery runs the
// handler again. The window is the time between the effect and Confirm.
// With [Config.ConfirmInTx] on PostgreSQL, the claim of an attempt that a
// crash of the database cut short may be lost with it, and its attempt
// count with it: the count is one lower than it would be.
// Keys are confirmed forever unless pruned: run [Store.Prune] with a
// retention longer than the longest time the broker may redeliver a message.
package dedupe
