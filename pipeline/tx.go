package pipeline

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// TxFunc is a handler that runs in a database transaction. TTx is the
// transaction type of TxConfig.DB's driver: *sql.Tx for sqldb.Std, pgx.Tx
// for sqldb.Pgx. It does its writes on tx and publishes its messages on out,
// the outbox bound to tx (nil when TxConfig.Outbox is nil). It must not
// commit or roll back tx.
type TxFunc[TTx any] func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error

// TxConfig configures a transactional handler (NewTxHandler,
// NewBatchTxHandler, HandleTx, HandleBatchTx). TTx is the transaction type
// of DB's driver.
type TxConfig[TTx any] struct {
	// DB is the database of the handler's writes, the dedupe claims table
	// and the outbox: sqldb.Std(db, dialect) or sqldb.Pgx(pool). Required.
	// Behind the dedupe middleware its pool needs two connections per
	// delivery in flight: the transaction, and the claim's renewal beside
	// it (with one, each confirmation waits for the renewal's StoreTimeout;
	// see docs/operating.md, "Database connections").
	DB sqldb.Driver[TTx]
	// Outbox, if set, gives the handler a publisher whose messages commit
	// with its writes (outbox.Outbox.TxPublisher). It must be an outbox on
	// DB's database.
	Outbox *outbox.Outbox[TTx]
	// TxOptions are the isolation level and read-only flag of the
	// transactions (mapped onto pgx's on sqldb.Pgx). Nil means the
	// database's default.
	TxOptions *sql.TxOptions
	// OneStatement takes the message's key inside the transaction, written
	// as confirmed at once (dedupe.SQLStore.ClaimConfirmed): one statement
	// per message instead of two, and the handler needs no dedupe middleware.
	// The price: an attempt that rolls back or dies with its process leaves
	// no durable count (count attempts with the broker's delivery count), and
	// a concurrent delivery of the same key waits for the transaction instead
	// of being deferred. A delivery the broker's count leaves with no
	// attempt still has its key claimed (HandleTx: the retry middleware's
	// RetryConfig.StoreInside): a duplicate when an earlier delivery
	// confirmed it; otherwise fn is not run, the key is committed as
	// refused (dedupe.SQLStore.Refuse, one more statement and the commit,
	// on this path only) and the message is dead-lettered. A delivery that
	// finds its key refused is dead-lettered without a run too, whatever
	// attempts it has left: it is an earlier delivery of the same message,
	// held by a worker that froze or was cut off (see NewTxHandler), and
	// the message's fate is decided. The same holds for Batch. Requires
	// Store.
	OneStatement bool
	// Store is the claims table on DB's database, for OneStatement and Batch,
	// whose transactions write the keys. HandleTx and HandleBatchTx use it
	// in every mode (the dedupe middleware's store too), and take
	// Config.Store when it is nil, which must then be a
	// *dedupe.SQLStore[TTx]. Behind a dedupe middleware of your own it is
	// not needed.
	Store *dedupe.SQLStore[TTx]
	// Key derives the key for OneStatement and Batch. Defaults to the
	// message UUID (HandleTx: to Config.Key).
	Key dedupe.KeyFunc
	// Batch turns on group commit: deliveries in flight at the same time
	// share one transaction (see BatchConfig). Their keys are written as
	// confirmed inside it, as with OneStatement, so it requires Store and
	// needs no dedupe middleware. NewBatchTxHandler needs MaxSize >= 2.
	Batch BatchConfig
	// BusyDelay is how long a delivery whose key another worker holds waits
	// before it is nacked, in OneStatement and Batch modes (the dedupe
	// middleware's own BusyDelay covers the default mode): it is deferred,
	// not an attempt. It is also how long a delivery waits before it is
	// deferred because the database does not answer, and the pause before a
	// transaction that lost its connection is run again (see NewTxHandler).
	// Defaults to 1s when zero; settle.NoDelay nacks at once.
	// HandleTx sets it from Config.BusyDelay.
	BusyDelay time.Duration
	// Scope names the logical handler of the key for OneStatement and
	// Batch, as dedupe.Config.Scope does for the middleware. Defaults to
	// dedupe.HandlerScope.
	Scope dedupe.ScopeFunc
	// CallTimeout bounds each call settle makes on the database for a
	// delivery: BEGIN, the claim of the key (OneStatement, Batch), the hold
	// and confirmation of the dedupe middleware's claim, COMMIT and
	// ROLLBACK; in OneStatement and Batch modes, whose transaction holds the
	// key itself and has no claim to renew, the handler's function too (its
	// context's deadline; its failure is then its own, an attempt). A call
	// that does not return within it, as behind a silent network partition,
	// is abandoned: its connection is closed (and dropped from the pool),
	// the transaction is rolled back and the delivery deferred (an error
	// wrapping ErrCallTimeout and dedupe.ErrUnavailable), no attempt spent.
	// On PostgreSQL each transaction also sets, for itself only,
	// lock_timeout to CallTimeout/2 and
	// idle_in_transaction_session_timeout to 2*CallTimeout, so that
	// settle's statements do not wait longer for a row lock held by a
	// vanished client and the server ends a transaction whose client fell
	// silent. They cost no round trip of their own: the statement of
	// settle's that comes first sets them (set_config in the claim of the
	// key with OneStatement, in the confirmation behind the dedupe
	// middleware, before either locks the key's row); a batch's
	// transaction sets them at BEGIN (pgx sends them in BEGIN's round trip,
	// database/sql right after it). A wait for a table lock (a migration's
	// ALTER TABLE on the claims table) that the statement setting them
	// meets before it runs is bounded by CallTimeout alone. They bound
	// settle's statements, not the handler's work: behind the dedupe
	// middleware, where the handler's function runs as long as it takes,
	// they are set after it returns, by the confirmation, and the function
	// runs under the session's own settings; in OneStatement and Batch
	// modes, where the function has CallTimeout as its deadline anyway,
	// they are set before it and hold for its statements too (a lock wait
	// past CallTimeout/2 fails it; a batch's idle limit also allows for
	// Batch.MaxWait). What ends a
	// vanished consumer's transaction while its handler runs behind the
	// middleware is the server's TCP keepalive, or an
	// idle_in_transaction_session_timeout of the session's own; see
	// docs/operating.md for those and for the settings the other databases
	// need. On SQLite, a file of this machine, no call has a deadline.
	// Defaults to 15s (half the dedupe middleware's default claim
	// timeout); HandleTx sets it from Config.StoreTimeout (ClaimTimeout/2,
	// at least 1s). Must be 0 or >= 10ms.
	CallTimeout time.Duration
}

// validate reports the first invalid field.
func (c *TxConfig[TTx]) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("pipeline: TxConfig.DB is required")
	case c.OneStatement && c.Store == nil:
		return errors.New("pipeline: TxConfig.Store is required with OneStatement")
	case c.BusyDelay < 0 && c.BusyDelay != settle.NoDelay:
		return fmt.Errorf("pipeline: TxConfig.BusyDelay must be >= 0 or settle.NoDelay, got %v", c.BusyDelay)
	case c.Batch.MaxSize < 0:
		return fmt.Errorf("pipeline: TxConfig.Batch.MaxSize must be >= 0, got %d", c.Batch.MaxSize)
	case c.Batch.enabled() && c.Store == nil:
		return errors.New("pipeline: TxConfig.Store is required with Batch")
	}
	return validCallTimeout(c.CallTimeout)
}

// NewTxHandler returns a consumer handler that runs fn in a transaction and
// commits the handler's writes, its outbox messages and the dedupe
// confirmation of the message's key together, or none of them. It publishes
// through the outbox, never through the router, so it is a
// message.NoPublishHandlerFunc. In its default mode it must sit behind the
// dedupe middleware with a dedupe.SQLStore on the same database (with
// OneStatement or Batch it claims the keys itself and needs no middleware;
// behind one anyway, it confirms the middleware's claims in its
// transaction):
//
//	db := sqldb.Std(sqlDB, sqldb.Postgres) // or sqldb.Pgx(pool): fn then gets a pgx.Tx
//	dd, _ := dedupe.NewMiddleware(dedupe.Config{Store: store})
//	h, _ := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: db, Outbox: ob}, charge)
//	router.AddConsumerHandler("charge", "orders", sub, h).AddMiddleware(dd)
//
// The flow of one delivery: the middleware claims the key (outside the
// transaction, so the attempt count survives rollbacks and crashes); the
// handler begins a transaction, calls fn, confirms the claim inside the
// transaction and commits. The commit's error is the handler's result: a
// failed commit releases the claim and the message is retried; a successful
// one makes every later delivery of the key a duplicate. The effect inside the
// database happens exactly once. A panic of fn rolls the transaction back
// and goes on, to the router's recoverer; the dedupe middleware releases
// the claim and the message is retried as after any failure.
//
// A replayed copy addressed to another handler (settle.MetaReplayHandler
// names a handler other than this one, its "#N" suffix dropped) is acked as
// a duplicate before any claim or transaction, as the dedupe middleware
// does; so is it by a batch handler (NewBatchTxHandler).
//
// A transaction that loses its database connection (the server ended the
// session, the connection was reset or killed, the driver found it broken;
// whichever statement met it, fn's, the outbox's, the confirmation or the
// commit) is not the message's failure: it is run again on a new connection
// after BusyDelay, up to three times, under the same claim, and the
// delivery is then deferred (an error wrapping ErrConnectionLost and
// dedupe.ErrUnavailable), no attempt spent. An error of fn counts as a lost
// connection only when its transaction's connection is found dead too; see
// docs/retry.md for the classes.
//
// With OneStatement or Batch the transaction run again claims the key
// again, in the new transaction, and goes by what it finds. A worker that
// froze in the middle of a transaction (SIGSTOP, a long pause, a partition)
// may wake up to find that the server ended it, the broker redelivered the
// message, and another worker, its count used up, dead-lettered it: that
// worker committed the key as refused first, so the rerun finds it refused
// and dead-letters its delivery too instead of running fn; the same for a
// worker that froze before its transaction began. The message is never both
// done and dead-lettered; two dead-letter copies of it may be made.
func NewTxHandler[TTx any](cfg TxConfig[TTx], fn TxFunc[TTx]) (message.NoPublishHandlerFunc, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("pipeline: NewTxHandler: fn is nil")
	}
	f := cfg.flow(fn, nil)
	if cfg.Batch.enabled() {
		return newBatcher(f).handle, nil
	}
	return func(msg *message.Message) error {
		if forAnother(msg) {
			return nil
		}
		return runTx(msg.Context(), f, msg)
	}, nil
}

// txn is one transaction of a transactional handler. The flow of a
// delivery, or of a batch of them, is written once against it (runTx,
// batcher.runOnce); dbTxn is its one implementation, on any sqldb.Driver,
// and boundTxn bounds its calls.
type txn interface {
	// claims is the dedupe store bound to the transaction (OneStatement
	// and Batch only).
	claims() claimer
	// hold and confirm are dedupe.HoldTx and dedupe.ConfirmTx on the
	// transaction, for handlers behind the dedupe middleware.
	hold(ctx context.Context) error
	confirm(ctx context.Context) error
	// call runs the handler's function for msg in the transaction.
	call(ctx context.Context, msg *message.Message) error
	// callBatch runs a batch handler's function for msgs in the transaction.
	callBatch(ctx context.Context, msgs []*message.Message) error
	commit(ctx context.Context) error
	// rollback rolls back; it returns nil when the transaction had ended.
	rollback(ctx context.Context) error
	// probe asks whether the transaction's connection still works: an
	// error of connTrouble's classes when it does not. A transaction that
	// a failed statement aborted (PostgreSQL) still has a working
	// connection.
	probe(ctx context.Context) error
	// setLocal runs statements in the transaction (serverTimeouts').
	setLocal(ctx context.Context, query string) error
}

// claimer is what a transactional handler asks of the store bound to its
// transaction (dedupe.SQLStore.WithTx).
type claimer interface {
	ClaimConfirmed(ctx context.Context, key string) (dedupe.Claim, error)
	ClaimConfirmedAll(ctx context.Context, keys []string) ([]dedupe.Claim, error)
	Refuse(ctx context.Context, key string) error
}

// txFlow is a transactional handler's configuration, the driver's type
// aside.
type txFlow struct {
	begin        func(ctx context.Context) (txn, error)
	oneStatement bool
	key          dedupe.KeyFunc
	scope        dedupe.ScopeFunc
	batch        BatchConfig
	batchHandler bool          // the batcher calls callBatch, not call
	beginEarly   bool          // a batch begins its transaction at its first delivery, before it fills
	busyDelay    time.Duration // with its default applied
	committed    func()        // after each commit; nil for none
}

// flow is cfg's flow for fn, or for batchFn (a batch handler) when fn is nil.
func (cfg TxConfig[TTx]) flow(fn TxFunc[TTx], batchFn BatchTxFunc[TTx]) txFlow {
	var committed func()
	if cfg.Outbox != nil {
		committed = cfg.Outbox.Notify // a relay of this process forwards at once
	}
	return txFlow{
		begin: cfg.bounds(fn == nil).bound(func(ctx context.Context, setup string) (txn, error) {
			tx, err := cfg.DB.Begin(ctx, cfg.TxOptions, setup)
			if err != nil {
				return nil, err
			}
			return &dbTxn[TTx]{cfg: &cfg, fn: fn, batchFn: batchFn, tx: tx}, nil
		}),
		oneStatement: cfg.OneStatement, key: cfg.Key, scope: cfg.Scope, batch: cfg.Batch,
		batchHandler: fn == nil, busyDelay: settlement.Delay(cfg.BusyDelay, time.Second),
		committed: committed,
		// BEGIN is a round trip to a server worth hiding in the batch's
		// wait; SQLite's is a call in the process, and settle's SQLite
		// URLs begin IMMEDIATE, which would hold the database's write lock
		// while the batch fills.
		beginEarly: cfg.DB.Dialect() != sqldb.SQLite,
	}
}

// dbTxn is a transaction on a sqldb.Driver.
type dbTxn[TTx any] struct {
	cfg     *TxConfig[TTx]
	fn      TxFunc[TTx]
	batchFn BatchTxFunc[TTx]
	tx      TTx
	outboxBinding
}

func (t *dbTxn[TTx]) claims() claimer                   { return t.cfg.Store.WithTx(t.tx) }
func (t *dbTxn[TTx]) hold(ctx context.Context) error    { return dedupe.HoldTx(ctx, t.tx) }
func (t *dbTxn[TTx]) confirm(ctx context.Context) error { return dedupe.ConfirmTx(ctx, t.tx) }
func (t *dbTxn[TTx]) commit(ctx context.Context) error  { return t.cfg.DB.Commit(ctx, t.tx) }
func (t *dbTxn[TTx]) rollback(ctx context.Context) error {
	return t.cfg.DB.Rollback(ctx, t.tx)
}

// probe asks the driver (sqldb.Executor.Alive): database/sql runs a
// statement that needs nothing but the connection, pgx looks at the
// connection without a round trip.
func (t *dbTxn[TTx]) probe(ctx context.Context) error { return t.cfg.DB.Tx(t.tx).Alive(ctx) }

func (t *dbTxn[TTx]) setLocal(ctx context.Context, query string) error {
	_, err := t.cfg.DB.Tx(t.tx).Exec(ctx, query)
	return err
}

// call runs fn with the outbox bound to the transaction, bound at the first
// call.
func (t *dbTxn[TTx]) call(ctx context.Context, msg *message.Message) error {
	if err := t.bindOutbox(); err != nil {
		return err
	}
	return t.fn(ctx, t.tx, msg, inContext(ctx, t.out))
}

func (t *dbTxn[TTx]) callBatch(ctx context.Context, msgs []*message.Message) error {
	if err := t.bindOutbox(); err != nil {
		return err
	}
	return t.batchFn(ctx, t.tx, msgs, inContext(ctx, t.out))
}

// bindOutbox binds the outbox to the transaction once.
func (t *dbTxn[TTx]) bindOutbox() error {
	if t.cfg.Outbox == nil {
		return nil
	}
	return t.bind(func() (message.Publisher, error) { return t.cfg.Outbox.TxPublisher(t.tx) })
}

// outboxBinding is the outbox publisher of a transaction,
// bound at its first handler call; in a batch it holds the messages back
// and writes them in one insert before the commit (outboxBuffering).
type outboxBinding struct {
	out    message.Publisher // the outbox bound to the transaction; nil until bound
	buffer bool              // hold outbox messages until flushOutbox (batches)
	held   *publishBuffer    // out, when buffer is set
}

// bind binds the publisher that publisher makes, once.
func (b *outboxBinding) bind(publisher func() (message.Publisher, error)) error {
	if b.out != nil {
		return nil
	}
	out, err := publisher()
	if err != nil {
		return err
	}
	b.out = out
	if b.buffer {
		b.held = &publishBuffer{next: out}
		b.out = b.held
	}
	return nil
}

func (b *outboxBinding) bufferOutbox() { b.buffer = true }

// flushOutbox writes the held messages under ctx, settle's (see
// publishBuffer.flush).
func (b *outboxBinding) flushOutbox(ctx context.Context) error {
	if b.held == nil {
		return nil
	}
	return b.held.flush(ctx)
}

// runTx runs one message through f in a transaction (see NewTxHandler). A
// transaction that loses its connection (connTrouble) is run again on a new
// one, after f.busyDelay, up to connReruns times, and the delivery is
// deferred after that: the database's trouble spends no attempt of the
// handler. Run again, not deferred at once, because behind the dedupe
// middleware the claim the delivery holds is its attempt count: a
// redelivery would claim the key again and count once more.
//
// A transaction whose confirmation found that the hold of the claim went by
// the wrong isolation level (sqlkit.ErrGuessedLevel; see dedupe.HoldTx) is
// run again the same way, the level then asked.
func runTx(ctx context.Context, f txFlow, msg *message.Message) error {
	ask := false
	for rerun := 0; ; rerun++ {
		lost, err := runTxOnce(ctx, f, msg, ask)
		if !lost {
			return err
		}
		ask = ask || errors.Is(err, sqlkit.ErrGuessedLevel)
		if rerun == connReruns || !settlement.Sleep(ctx, f.busyDelay) {
			return unavailable(ctx, f.busyDelay, err)
		}
	}
}

// runTxOnce runs one transaction of runTx. It reports lost, with an error
// wrapping ErrConnectionLost, when the transaction lost its connection at a
// point where running it again is safe: nothing of it landed, or (a commit
// that lost its connection, in the one-statement mode) the claim of the key
// in the next transaction says whether it did.
//
// ask: the transaction's isolation level is to be asked, not taken from the
// transactions before (sqlkit.TxHints.Ask); it also reports lost after
// sqlkit.ErrGuessedLevel.
func runTxOnce(ctx context.Context, f txFlow, msg *message.Message, ask bool) (lost bool, err error) {
	t, err := f.begin(ctx)
	if err != nil {
		return false, unavailable(ctx, f.busyDelay, fmt.Errorf("pipeline: begin: %w", err))
	}
	if bt, ok := t.(*boundTxn); ok {
		bt.ask = ask
	}
	defer func() {
		// After a commit this is a no-op; after an error or a panic it is
		// what frees the transaction's locks. On a connection that was lost
		// it has nothing to free, and its error says nothing new.
		if rerr := t.rollback(context.WithoutCancel(ctx)); rerr != nil && err != nil && !lost {
			err = errors.Join(err, fmt.Errorf("pipeline: rollback: %w", rerr))
		}
	}()
	// Behind the dedupe middleware, its claim is the key's, even with
	// OneStatement: it is confirmed in the transaction.
	_, held := dedupe.ClaimFromContext(ctx)
	inTx := f.oneStatement && !held
	if inTx {
		// No attempt left by the retry middleware's count (the broker's):
		// the claim only says whether an earlier delivery did the work.
		last := settlement.FromContext(ctx).NoAttemptLeft()
		key, err := dedupe.MessageKey(msg, f.key, f.scope)
		if err != nil {
			return false, fmt.Errorf("pipeline: key of message %s: %w", msg.UUID, err)
		}
		recordKey(ctx, msg, f.key)
		c, err := t.claims().ClaimConfirmed(ctx, key)
		switch {
		case lostOnce(err):
			return true, withConnLost(err)
		case err != nil:
			return false, unavailable(ctx, f.busyDelay, err)
		}
		done, err := claimResult(ctx, c, msg)
		if errors.Is(err, dedupe.ErrBusy) {
			_ = t.rollback(ctx) // hold no connection while waiting
			settlement.Sleep(ctx, f.busyDelay)
		}
		if err != nil || done {
			return false, err // a duplicate or a refused key has nothing to commit: the rollback ends it
		}
		if last {
			return refuseDurably(ctx, f, t, key, msg)
		}
	} else if err = t.hold(ctx); err != nil {
		return false, claimTrouble(ctx, f, err)
	}
	if err = t.call(ctx, msg); err != nil {
		if handlerLostConnection(ctx, t, err) {
			return true, withConnLost(err)
		}
		return false, err
	}
	if !inTx {
		if err = t.confirm(ctx); err != nil {
			if errors.Is(err, sqlkit.ErrGuessedLevel) {
				// Nothing landed, and the claim is still the delivery's
				// unless the next hold finds it lost.
				return true, err
			}
			if !claimsOwnFailure(err) && lostOnce(err) {
				// Nothing landed, and the claim is still the delivery's
				// (a takeover would fail the next confirmation).
				return true, withConnLost(err)
			}
			return false, claimTrouble(ctx, f, err)
		}
	}
	if err = t.commit(ctx); err != nil {
		switch {
		case errors.Is(err, ErrCallTimeout):
			// Whether it committed is not known: the key's row decides
			// when the delivery comes back.
			return false, unavailable(ctx, f.busyDelay, fmt.Errorf("pipeline: commit: %w", err))
		case connTrouble(err) && inTx:
			// Whether it committed is not known either; the claim in the
			// next transaction finds the key confirmed if it did.
			return true, withConnLost(fmt.Errorf("pipeline: commit: %w", err))
		case connTrouble(err):
			// Behind the middleware a second transaction would not know
			// (its confirmation fails either way): the redelivery's
			// claim decides, a duplicate if it landed.
			return false, unavailable(ctx, f.busyDelay, withConnLost(fmt.Errorf("pipeline: commit: %w", err)))
		}
		return false, fmt.Errorf("pipeline: commit: %w", err)
	}
	if f.committed != nil {
		f.committed()
	}
	return false, nil
}

// lostOnce reports whether err, from a statement settle ran on a
// transaction, is its connection going away (connTrouble) in a way another
// transaction may not meet: not settle's deadline on the call
// (ErrCallTimeout), after which the database is taken not to answer, and
// the delivery deferred at once rather than made to wait as long again.
func lostOnce(err error) bool {
	return connTrouble(err) && !errors.Is(err, ErrCallTimeout)
}

// forAnother reports whether msg is a replayed copy addressed to another
// handler (settle.MetaReplayHandler), and then settles it as the dedupe
// middleware does: a duplicate, acked without a claim, a transaction or a
// run. Behind the middleware it never gets here.
func forAnother(msg *message.Message) bool {
	ctx := msg.Context()
	if _, other := replay.ForAnother(message.HandlerNameFromCtx(ctx), msg.Metadata); !other {
		return false
	}
	settlement.FromContext(ctx).SetOutcome(settlement.Duplicate)
	return true
}

// claimResult settles what a claim in the transaction found: done for a
// duplicate (acked, nothing to run), an error wrapping dedupe.ErrBusy for a
// key held elsewhere (deferred), an error wrapping dedupe.ErrAttemptsUsedUp
// for a refused key (dead-lettered, nothing run, whatever attempts the
// delivery has left: another delivery of its message, with none left,
// refused it and dead-lettered it, or is about to), neither for an
// acquired key.
//
// A refused key's delivery is dead-lettered, not acked: the delivery that
// refused the key may have died between the commit of the refusal and the
// dead-letter copy, and an ack here could settle the message (NATS
// JetStream and Redis Streams take an ack from an earlier delivery) with no
// copy anywhere. Two copies of one message can land on the dead-letter
// topic; a parked-message store keeps one row of them.
func claimResult(ctx context.Context, c dedupe.Claim, msg *message.Message) (done bool, err error) {
	switch c.Result {
	case dedupe.Duplicate:
		settlement.FromContext(ctx).SetOutcome(settlement.Duplicate)
		return true, nil
	case dedupe.Busy:
		settlement.FromContext(ctx).Defer() // not an attempt
		return false, fmt.Errorf("%w (message %s)", dedupe.ErrBusy, msg.UUID)
	case dedupe.Refused:
		return false, refuse(ctx, msg, "key refused by an earlier delivery with no attempt left")
	}
	return false, nil
}

// refuseDurably settles a delivery with no attempt left whose key the claim
// in transaction t acquired (no earlier delivery confirmed it): its
// function is not run, the key is turned into a refused one
// (dedupe.SQLStore.Refuse) and committed, and only then is the delivery
// refused (refuse), for the retry middleware to dead-letter. Committed
// before the dead-letter copy is made, the refusal is what another delivery
// of the message still in flight finds when it claims the key: a worker
// that froze with it and wakes up, whether before its transaction began or
// after the server ended that transaction (which it would run again); it
// is refused too instead of running, and no message is both done and
// dead-lettered. A refusal that could not be committed dead-letters
// nothing: the delivery is deferred (or, the connection lost, its
// transaction run again), and its redelivery looks again.
func refuseDurably(ctx context.Context, f txFlow, t txn, key string, msg *message.Message) (lost bool, err error) {
	if err := t.claims().Refuse(ctx, key); err != nil {
		if lostOnce(err) {
			return true, withConnLost(err)
		}
		return false, unavailable(ctx, f.busyDelay, fmt.Errorf("pipeline: refuse: %w", err))
	}
	if err := t.commit(ctx); err != nil {
		if connTrouble(err) && !errors.Is(err, ErrCallTimeout) {
			// Whether it committed is not known: the claim in the next
			// transaction finds the key refused if it did.
			return true, withConnLost(fmt.Errorf("pipeline: commit refusal: %w", err))
		}
		return false, unavailable(ctx, f.busyDelay, fmt.Errorf("pipeline: commit refusal: %w", err))
	}
	return false, refuse(ctx, msg, "key not confirmed, no attempt left")
}

// refuse records on the delivery's settlement that it is refused without a
// run, for the retry middleware to dead-letter it, and returns its error,
// which wraps dedupe.ErrAttemptsUsedUp; why says what the claim found.
func refuse(ctx context.Context, msg *message.Message, why string) error {
	rec := settlement.FromContext(ctx)
	limit, _ := rec.Limit()
	rec.Refuse(limit + 1)
	return fmt.Errorf("%w: message %s, %s (limit %d)", dedupe.ErrAttemptsUsedUp, msg.UUID, why, limit)
}

// claimTrouble is the result of a delivery whose claim from the dedupe
// middleware could not be held or confirmed in its transaction: its own
// failure when claimsOwnFailure says so; otherwise the store is not
// answering, which defers the delivery, as when the transaction cannot
// begin.
func claimTrouble(ctx context.Context, f txFlow, err error) error {
	if claimsOwnFailure(err) {
		return err
	}
	return unavailable(ctx, f.busyDelay, err)
}

// claimsOwnFailure reports whether err, from holding or confirming the
// dedupe middleware's claim in a transaction, is the delivery's own failure:
// the claim is no longer its own (ErrClaimLost: it expired and was taken
// over), or there is none (ErrNoClaim: no middleware in front of the default
// mode). Any other error is the store's.
func claimsOwnFailure(err error) bool {
	return errors.Is(err, dedupe.ErrClaimLost) || errors.Is(err, dedupe.ErrNoClaim)
}

// unavailable defers a delivery whose transaction could not begin or whose
// key could not be claimed: the database is not answering, and that is not
// an attempt of the handler. It waits delay first, so that an outage is not
// a hot loop of nacks.
func unavailable(ctx context.Context, delay time.Duration, err error) error {
	settlement.FromContext(ctx).Defer()
	settlement.Sleep(ctx, delay)
	return fmt.Errorf("%w: %w", dedupe.ErrUnavailable, err)
}

// recordKey writes msg's key as keyFn gives it (the UUID when keyFn is nil;
// not the stored, scoped form) on the delivery's settlement record in ctx,
// for a parking middleware outside that records the message, as the dedupe
// middleware does for the keys it claims. Called once dedupe.MessageKey
// has accepted the key.
func recordKey(ctx context.Context, msg *message.Message, keyFn dedupe.KeyFunc) {
	key := msg.UUID
	if keyFn != nil {
		var err error
		if key, err = keyFn(msg); err != nil {
			return
		}
	}
	settlement.FromContext(ctx).SetKey(key)
}
