package pipeline

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// ErrCallTimeout is wrapped by the error of a database call that settle made
// for a delivery and abandoned after TxConfig.CallTimeout: the database did not answer, as behind a silent
// network partition. The transaction is rolled back and the delivery is
// deferred (the error also wraps dedupe.ErrUnavailable), except when the
// call was the handler's own function, whose failure it is.
var ErrCallTimeout = errors.New("pipeline: the database did not answer within CallTimeout")

// defaultCallTimeout is TxConfig.CallTimeout when it is not set and no
// Pipeline sets it: half of the dedupe middleware's default claim timeout.
const defaultCallTimeout = 15 * time.Second

// callTimeout applies CallTimeout's default.
func callTimeout(d time.Duration) time.Duration {
	if d == 0 {
		return defaultCallTimeout
	}
	return d
}

// validCallTimeout reports a CallTimeout that cannot be used.
func validCallTimeout(d time.Duration) error {
	if d < 0 || d > 0 && d < 10*time.Millisecond {
		// Below 10ms no database answers: every delivery would be
		// deferred for ever without a run.
		return fmt.Errorf("pipeline: TxConfig.CallTimeout must be 0 (meaning %v) or >= 10ms, got %v", defaultCallTimeout, d)
	}
	return nil
}

// serverTimeouts returns the statements that give a PostgreSQL transaction
// of settle's its server-side bounds for the rest of it (SET LOCAL: that
// transaction only; and SET takes no snapshot, unlike a SELECT of
// set_config, so that at REPEATABLE READ and SERIALIZABLE the snapshot is
// still taken by the statement after it): lock_timeout, so that none of its statements waits longer than
// half a call for a lock (one held by a client that vanished behind a
// partition, above all), and idle_in_transaction_session_timeout, so that
// the server ends the session, and frees its locks, when the client falls
// silent in the middle of the transaction for two calls' time (plus wait,
// the longest a batch's transaction, begun at its first delivery, may idle
// while the others join).
//
// They bound settle's own statements, not the handler's work: a
// transaction sets them before the handler's function only when it runs
// with the call's deadline anyway (OneStatement, batches: see
// bounded.early), and otherwise (behind the dedupe middleware, where the
// function runs as long as it takes) with settle's final statements, the
// confirmation and COMMIT. These statements are sent only where no
// statement of the dedupe store set the values first (serverTimeoutMillis,
// sqlkit.TxHints): a batch's BEGIN, and a confirmation or claim that did
// not carry them. Carried, they cost no round trip, which on database/sql
// was one per message (pgx sends setup with BEGIN); but they take effect
// when the statement runs, after it took its table locks (at parse, or
// when a cached plan is checked), so a wait for a table lock held by DDL
// is bounded by the call's deadline, not lock_timeout. Row locks, which
// other consumers and their zombies hold, are waited for after.
func serverTimeouts(d, wait time.Duration) string {
	lock, idle := serverTimeoutMillis(d, wait)
	return "SET LOCAL lock_timeout = " + lock + "; SET LOCAL idle_in_transaction_session_timeout = " + idle
}

// serverTimeoutMillis is serverTimeouts' lock_timeout and
// idle_in_transaction_session_timeout, in milliseconds.
func serverTimeoutMillis(d, wait time.Duration) (lock, idle string) {
	return strconv.FormatInt(max(d/2, time.Millisecond).Milliseconds(), 10),
		strconv.FormatInt(max(2*d+max(wait, 0), time.Millisecond).Milliseconds(), 10)
}

// batchWait is how long a batch's transaction, begun when its first
// delivery arrives (txFlow.beginEarly), may wait idle for the others: the
// batch's MaxWait; 0 without batching.
func batchWait(c BatchConfig) time.Duration {
	switch {
	case !c.enabled() || c.MaxWait < 0:
		return 0
	case c.MaxWait == 0:
		return defaultBatchWait
	}
	return c.MaxWait
}

// bounded is what bound needs to know of a flow.
type bounded struct {
	d time.Duration
	// limits is serverTimeouts' statements, or "" (not PostgreSQL);
	// lockMs and idleMs are their values.
	limits, lockMs, idleMs string
	// carried: the flow's first statement of settle's after BEGIN is the
	// claim of the key in the transaction (OneStatement, one delivery per
	// transaction), which sets the limits itself (sqlkit.TxHints) rather
	// than a SET LOCAL at BEGIN, a round trip of its own on database/sql.
	carried bool
	// level is the isolation level the transactions begin at, as
	// PostgreSQL names it, or "" for the session's default.
	level string
	// batchFn: the flow runs a batch function (callBatch), which always
	// has the call's deadline.
	batchFn bool
}

// early reports whether the handler's function, in a transaction begun
// with ctx, runs with the call's deadline (see boundTxn.call), and so the
// server-side limits can be set at BEGIN without bounding it more than it
// is: a batch function, or a function whose delivery holds no claim of the
// dedupe middleware (OneStatement, batches without the middleware). Behind
// the middleware the function runs as long as it takes, under the
// session's own settings, and the limits come after it.
func (b bounded) early(ctx context.Context) bool {
	if b.batchFn {
		return true
	}
	_, held := dedupe.ClaimFromContext(ctx)
	return !held
}

// bound returns begin with every call of the transactions it begins
// bounded by b.d. begin begins a transaction that runs limits (b.limits or
// "") right at its BEGIN (sqldb.Driver.Begin's setup): in the same round
// trip where the driver allows it (pgx), as the next statement otherwise. The transaction's context,
// which database/sql ties the transaction to, is begin's context made
// cancellable: a BEGIN, COMMIT or ROLLBACK that runs past the deadline
// cancels it, which makes the driver abandon the call and close the
// connection (database/sql then drops it from the pool), and the
// transaction is rolled back by the server.
func (b bounded) bound(begin func(ctx context.Context, limits string) (txn, error)) func(context.Context) (txn, error) {
	if b.d <= 0 {
		return func(ctx context.Context) (txn, error) { return begin(ctx, "") }
	}
	return func(ctx context.Context) (txn, error) {
		now, later := b.limits, ""
		if !b.early(ctx) || b.carried {
			now, later = "", b.limits
		}
		tctx, cancel := context.WithCancelCause(ctx)
		guard := time.AfterFunc(b.d, func() { cancel(ErrCallTimeout) })
		t, err := begin(tctx, now)
		if !guard.Stop() {
			err = errors.Join(ErrCallTimeout, err)
		}
		if err != nil {
			if t != nil {
				_ = t.rollback(context.WithoutCancel(ctx))
			}
			cancel(nil)
			return nil, timedOut(tctx, err)
		}
		return &boundTxn{txn: t, bounded: b, end: cancel, pending: later}, nil
	}
}

// timedOut is err, wrapping ErrCallTimeout when ctx ended with it.
func timedOut(ctx context.Context, err error) error {
	if err == nil || errors.Is(err, ErrCallTimeout) || !errors.Is(context.Cause(ctx), ErrCallTimeout) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrCallTimeout, err)
}

// boundTxn is a transaction whose calls are bounded.
type boundTxn struct {
	txn
	bounded
	end   context.CancelCauseFunc // cancels the transaction's context
	ended bool                    // committed, or rolled back
	// pending is the server-side limits not set at BEGIN (see
	// bounded.early and bounded.carried), set by the claim in the
	// transaction (carried), else by the confirmation, else by a SET
	// LOCAL before the commit; "" once set, or when there are none.
	pending string
	// hints carry pending to the dedupe store's statement, and what the
	// transaction knows of its isolation level.
	hints sqlkit.TxHints
	// ask: the level is to be asked, not taken from the transactions
	// before (a rerun after sqlkit.ErrGuessedLevel).
	ask bool
	// calls are the contexts of the handler calls, cancelled when the
	// transaction ends: what a handler published may still be written
	// with them after it returned (a batch's outbox rows).
	calls []context.CancelCauseFunc
}

// watch returns ctx for one handler call, cancelled (cause ErrCallTimeout)
// if the call runs past the deadline, and the function that stops the
// watch when the call returns. The context lives on, uncancelled, until
// the transaction ends.
func (t *boundTxn) watch(ctx context.Context) (context.Context, func() bool) {
	cctx, cancel := context.WithCancelCause(ctx)
	t.calls = append(t.calls, cancel)
	timer := time.AfterFunc(t.d, func() { cancel(ErrCallTimeout) })
	return cctx, timer.Stop
}

// done ends the transaction's contexts.
func (t *boundTxn) done() {
	t.end(nil)
	for _, c := range t.calls {
		c(nil)
	}
	t.calls = nil
}

// callCtx is ctx with the deadline of one call.
func (t *boundTxn) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, t.d, ErrCallTimeout)
}

func (t *boundTxn) claims() claimer { return boundClaimer{c: t.txn.claims(), t: t} }

// within runs op within the deadline of one call (timedOut names the
// deadline in its error).
func (t *boundTxn) within(ctx context.Context, op func(context.Context) error) error {
	cctx, cancel := t.callCtx(ctx)
	defer cancel()
	return timedOut(cctx, op(cctx))
}

// hold passes what the transaction knows of its isolation level to
// dedupe.HoldTx, which then need not ask; not the limits, which would
// bound the handler's function.
func (t *boundTxn) hold(ctx context.Context) error {
	return t.within(sqlkit.WithTxHints(ctx, &sqlkit.TxHints{Level: t.level, Ask: t.ask}), t.txn.hold)
}

// confirm confirms the claim with the limits still pending set by the
// confirmation's own statement, before it locks the claim's row (on
// PostgreSQL; a store that did not set them leaves them to limit).
func (t *boundTxn) confirm(ctx context.Context) error {
	if err := t.within(t.withHints(ctx), t.txn.confirm); err != nil {
		return err
	}
	return t.limit(ctx)
}

// withHints returns ctx carrying the transaction's hints, with the limits
// pending if any.
func (t *boundTxn) withHints(ctx context.Context) context.Context {
	t.hints = sqlkit.TxHints{Level: t.level, Ask: t.ask}
	if t.pending != "" {
		t.hints.Limits, t.hints.LockMillis, t.hints.IdleMillis = true, t.lockMs, t.idleMs
	}
	return sqlkit.WithTxHints(ctx, &t.hints)
}

// limit sets the server-side limits left for after the handler's function
// (pending), within a call's deadline, unless a statement of the dedupe
// store set them (hints.Carried).
func (t *boundTxn) limit(ctx context.Context) error {
	if t.pending == "" {
		return nil
	}
	if t.hints.Carried {
		t.pending = ""
		return nil
	}
	cctx, cancel := t.callCtx(ctx)
	defer cancel()
	if err := t.txn.setLocal(cctx, t.pending); err != nil {
		return timedOut(cctx, fmt.Errorf("pipeline: server-side timeouts: %w", err))
	}
	t.pending = ""
	return nil
}

// call runs the handler's function. Behind the dedupe middleware, whose
// claim is renewed while it runs (or held by the transaction) and cancels
// it when lost, it runs as long as it takes, and settle's server-side
// limits are not yet set (bounded.early); without it (OneStatement, Batch)
// the transaction holds the key and nothing else would end a call stuck on
// a silent connection, so it gets the call's deadline. Its failure is its
// own.
func (t *boundTxn) call(ctx context.Context, msg *message.Message) error {
	if _, held := dedupe.ClaimFromContext(ctx); held {
		return t.txn.call(ctx, msg)
	}
	cctx, stop := t.watch(ctx)
	err := t.txn.call(cctx, msg)
	stop()
	return timedOut(cctx, err)
}

func (t *boundTxn) callBatch(ctx context.Context, msgs []*message.Message) error {
	cctx, stop := t.watch(ctx)
	err := t.txn.callBatch(cctx, msgs)
	stop()
	return timedOut(cctx, err)
}

// probe is bounded like any call: a connection that cannot answer within
// the deadline is taken as gone.
func (t *boundTxn) probe(ctx context.Context) error { return t.within(ctx, t.txn.probe) }

func (t *boundTxn) commit(ctx context.Context) error {
	if err := t.limit(ctx); err != nil {
		return err
	}
	t.ended = true
	defer t.done()
	return t.finish(ctx, t.txn.commit)
}

func (t *boundTxn) rollback(ctx context.Context) error {
	if t.ended {
		return nil
	}
	t.ended = true
	defer t.done()
	return t.finish(ctx, t.txn.rollback)
}

// finish runs op (commit or rollback) within the deadline. op gets the
// call's deadline, but database/sql's Commit and Rollback take no context
// (sqldb.Std's ignore it), so op is waited for on a goroutine: at the
// deadline the transaction's context is cancelled, which drivers that read
// it (pgx, and pgx's stdlib) take as the order to abandon the call and
// close the connection; the others (the go-sql-driver's COMMIT) return
// when the connection dies, on their own, and are left to it.
func (t *boundTxn) finish(ctx context.Context, op func(context.Context) error) error {
	cctx, cancel := t.callCtx(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- op(cctx) }()
	timer := time.NewTimer(t.d)
	defer timer.Stop()
	select {
	case err := <-done:
		return timedOut(cctx, err)
	case <-timer.C:
		t.end(ErrCallTimeout)
		return ErrCallTimeout
	}
}

// bufferOutbox and flushOutbox pass a batch's outbox buffering through.
func (t *boundTxn) bufferOutbox() {
	if ob, ok := t.txn.(outboxBuffering); ok {
		ob.bufferOutbox()
	}
}

func (t *boundTxn) flushOutbox(ctx context.Context) error {
	ob, ok := t.txn.(outboxBuffering)
	if !ok {
		return nil
	}
	if err := t.limit(ctx); err != nil {
		return err
	}
	return t.within(ctx, ob.flushOutbox)
}

// boundClaimer is the claims of a bounded transaction.
type boundClaimer struct {
	c claimer
	t *boundTxn
}

// ClaimConfirmed claims key with the limits still pending set by the
// claim's own statement, before it locks the key's row; when the store did
// not set them, a SET LOCAL does, before the handler's function runs.
func (b boundClaimer) ClaimConfirmed(ctx context.Context, key string) (dedupe.Claim, error) {
	cctx, cancel := b.t.callCtx(ctx)
	defer cancel()
	c, err := b.c.ClaimConfirmed(b.t.withHints(cctx), key)
	if err != nil {
		return c, timedOut(cctx, err)
	}
	return c, b.t.limit(ctx)
}

func (b boundClaimer) ClaimConfirmedAll(ctx context.Context, keys []string) ([]dedupe.Claim, error) {
	cctx, cancel := b.t.callCtx(ctx)
	defer cancel()
	c, err := b.c.ClaimConfirmedAll(cctx, keys)
	return c, timedOut(cctx, err)
}

func (b boundClaimer) Refuse(ctx context.Context, key string) error {
	return b.t.within(ctx, func(ctx context.Context) error { return b.c.Refuse(ctx, key) })
}

// bounds is how the calls of cfg's transactions are bounded; batchFn: for
// a batch function.
func (cfg TxConfig[TTx]) bounds(batchFn bool) bounded {
	b := bounded{d: callTimeout(cfg.CallTimeout), batchFn: batchFn}
	switch cfg.DB.Dialect() {
	case sqldb.SQLite:
		// A file of this machine: no partition can cut it off, and its
		// writers wait for each other with its busy timeout.
		return bounded{}
	case sqldb.Postgres:
		b.limits = serverTimeouts(b.d, batchWait(cfg.Batch))
		b.lockMs, b.idleMs = serverTimeoutMillis(b.d, batchWait(cfg.Batch))
		b.carried = cfg.OneStatement && !cfg.Batch.enabled() && !batchFn
		b.level = postgresLevel(cfg.TxOptions)
	}
	return b
}

// postgresLevel is the isolation level opts begin a transaction at, as
// PostgreSQL names it (SHOW transaction_isolation), or "" for the session's
// default (nil opts, sql.LevelDefault) or a level PostgreSQL does not have
// (which BEGIN refuses).
func postgresLevel(opts *sql.TxOptions) string {
	if opts == nil {
		return ""
	}
	switch opts.Isolation {
	case sql.LevelReadUncommitted:
		return "read uncommitted"
	case sql.LevelReadCommitted:
		return "read committed"
	case sql.LevelRepeatableRead, sql.LevelSnapshot:
		return "repeatable read"
	case sql.LevelSerializable, sql.LevelLinearizable:
		return "serializable"
	}
	return ""
}

// warnServerTimeouts tells, when a transactional handler on MySQL or
// MariaDB is added, which of the server settings that end a
// vanished client's transaction its connections lack (settle cannot set
// them per transaction there; see docs/operating.md). It asks one
// connection of the pool, whose settings come from the server and the DSN.
func warnServerTimeouts[TTx any](cfg TxConfig[TTx], name string, logger watermill.LoggerAdapter) {
	if cfg.DB == nil || cfg.DB.Dialect() != sqldb.MySQL {
		return
	}
	d := callTimeout(cfg.CallTimeout)
	_ = checkNow(func(ctx context.Context) error {
		var lockWait, idle int64
		if err := cfg.DB.DB().QueryRow(ctx, "SELECT @@innodb_lock_wait_timeout", nil, &lockWait); err != nil {
			return err
		}
		if lockWait > int64(d.Seconds())+1 {
			logger.Info("pipeline: innodb_lock_wait_timeout is longer than CallTimeout: a statement waiting on a lock held by a vanished client waits that long on the server; set it in the DSN (see docs/operating.md)",
				watermill.LogFields{"handler": name, "innodb_lock_wait_timeout_s": lockWait, "call_timeout": d.String()})
		}
		if err := cfg.DB.DB().QueryRow(ctx, "SELECT @@idle_transaction_timeout", nil, &idle); err != nil {
			return nil // MySQL has no such setting: wait_timeout is the one
		}
		if idle == 0 {
			logger.Info("pipeline: idle_transaction_timeout is 0: a consumer cut off by a silent network partition in the middle of a transaction holds its keys' locks until wait_timeout; set it in the DSN (see docs/operating.md)",
				watermill.LogFields{"handler": name, "suggested_s": int64(2 * d.Seconds())})
		}
		return nil
	})
}
