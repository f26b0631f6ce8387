package pipeline

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/outbox"
)

// PgxTxFunc is a transactional handler on pgx: TxFunc with a pgx.Tx. It
// does its writes on tx and publishes its messages on out, the outbox bound
// to tx (outbox.Outbox.TxPublisher; nil when PgxTxConfig.Outbox is nil).
// It must not commit or roll tx back.
type PgxTxFunc func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error

// PgxBeginner starts the transactions of a pgx transactional handler.
// *pgxpool.Pool satisfies it; so does a *pgx.Conn, for a handler that never
// runs concurrently.
type PgxBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// PgxTxConfig configures a transactional handler on pgx. It is TxConfig
// for a service whose connections are a pgxpool.Pool; see TxConfig for the
// meaning of each mode.
type PgxTxConfig struct {
	// DB is the database of the handler's writes, the dedupe claims table
	// and the outbox. Required.
	DB PgxBeginner
	// Outbox, if set, gives the handler a publisher whose messages commit
	// with its writes. It must be a PostgreSQL outbox.
	Outbox *outbox.Outbox[pgx.Tx]
	// TxOptions are passed to BeginTx. The zero value is PostgreSQL's
	// default (read committed, read write).
	TxOptions pgx.TxOptions
	// OneStatement takes the message's key inside the transaction, written
	// as confirmed at once (dedupe.PgxStore.ClaimConfirmed), as
	// TxConfig.OneStatement does. Requires Store.
	OneStatement bool
	// Store is the claims table for OneStatement and Batch
	// (Pipeline.HandlePgxTx sets it).
	Store *dedupe.SQLStore[pgx.Tx]
	// Key derives the key for OneStatement and Batch. Defaults to the
	// message UUID.
	Key dedupe.KeyFunc
	// Batch turns on group commit, as TxConfig.Batch does. Requires Store.
	// NewPgxBatchTxHandler needs MaxSize >= 2.
	Batch BatchConfig
	// BusyDelay is how long a delivery whose key another worker holds waits
	// before it is nacked, in OneStatement and Batch modes, and the pause
	// before a transaction that lost its connection is run again, as
	// TxConfig.BusyDelay. Defaults to 1s when zero; settle.NoDelay nacks at
	// once. Pipeline.HandlePgxTx sets it from Config.BusyDelay.
	BusyDelay time.Duration
	// Scope names the logical handler of the key for OneStatement and
	// Batch. Defaults to dedupe.HandlerScope.
	Scope dedupe.ScopeFunc
	// CallTimeout bounds each call settle makes on the database for a
	// delivery, and sets the transaction's PostgreSQL lock and
	// idle-in-transaction timeouts, as TxConfig.CallTimeout does: in
	// OneStatement and Batch modes they ride in the BEGIN itself (no extra
	// round trip); behind the dedupe middleware they are one statement
	// after the handler's function, before the confirmation, so that they
	// bound settle's statements and not the function's. Defaults to
	// DefaultCallTimeout; Pipeline.HandlePgxTx sets it from
	// Config.StoreTimeout. Must be 0 or >= 10ms.
	CallTimeout time.Duration
}

// Validate reports the first invalid field.
func (c PgxTxConfig) Validate() error {
	switch {
	case c.DB == nil:
		return errors.New("pipeline: PgxTxConfig.DB is required")
	case c.OneStatement && c.Store == nil:
		return errors.New("pipeline: PgxTxConfig.Store is required with OneStatement")
	case c.BusyDelay < 0 && c.BusyDelay != settle.NoDelay:
		return fmt.Errorf("pipeline: PgxTxConfig.BusyDelay must be >= 0 or settle.NoDelay, got %v", c.BusyDelay)
	case c.Batch.MaxSize < 0:
		return fmt.Errorf("pipeline: PgxTxConfig.Batch.MaxSize must be >= 0, got %d", c.Batch.MaxSize)
	case c.Batch.enabled() && c.Store == nil:
		return errors.New("pipeline: PgxTxConfig.Store is required with Batch")
	}
	return validCallTimeout("PgxTxConfig", c.CallTimeout)
}

// NewPgxTxHandler is NewTxHandler on pgx: it runs fn in a pgx transaction
// and commits the handler's writes and the dedupe confirmation of the
// message's key together, or neither. Behind the dedupe middleware (with a
// dedupe.PgxStore on the same database) the claim is taken outside the
// transaction and confirmed inside it (dedupe.ConfirmTx); with
// OneStatement or Batch the key is written as confirmed inside it and no
// middleware is needed. The flow is the very one of NewTxHandler, whose
// documentation says the rest.
func NewPgxTxHandler(cfg PgxTxConfig, fn PgxTxFunc) (message.NoPublishHandlerFunc, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("pipeline: NewPgxTxHandler: fn is nil")
	}
	f := cfg.flow(fn, nil)
	if cfg.Batch.enabled() {
		return newBatcher(f).handle, nil
	}
	return func(msg *message.Message) error {
		return runTx(msg.Context(), f, msg)
	}, nil
}

// flow is cfg's flow for fn, or for batchFn (a batch handler) when fn is
// nil: the txFlow of TxConfig with pgx under it.
func (cfg PgxTxConfig) flow(fn PgxTxFunc, batchFn PgxBatchTxFunc) txFlow {
	b := cfg.bounds(fn == nil)
	limited := cfg.txOptionsWith(b.limits)
	return txFlow{
		begin: b.bound(func(ctx context.Context, limits string) (txn, error) {
			opts := cfg.TxOptions
			if limits != "" {
				opts = limited // b.limits, in the BEGIN's round trip
			}
			tx, err := cfg.DB.BeginTx(ctx, opts)
			if err != nil {
				return nil, err
			}
			return &pgxTxn{cfg: &cfg, fn: fn, batchFn: batchFn, tx: tx}, nil
		}),
		oneStatement: cfg.OneStatement, key: cfg.Key, scope: cfg.Scope, batch: cfg.Batch,
		batchHandler: fn == nil, busyDelay: settlement.Delay(cfg.BusyDelay, time.Second),
		committed: notifier(cfg.Outbox), beginEarly: true,
	}
}

// notifier is the outbox's in-process wake-up, or nil without an outbox.
func notifier[TTx any](ob *outbox.Outbox[TTx]) func() {
	if ob == nil {
		return nil
	}
	return ob.Notify
}

// pgxTxn is a pgx transaction.
type pgxTxn struct {
	cfg     *PgxTxConfig
	fn      PgxTxFunc
	batchFn PgxBatchTxFunc
	tx      pgx.Tx
	outboxBinding
}

func (t *pgxTxn) claims() claimer                   { return t.cfg.Store.WithTx(t.tx) }
func (t *pgxTxn) hold(ctx context.Context) error    { return dedupe.HoldTx(ctx, t.tx) }
func (t *pgxTxn) confirm(ctx context.Context) error { return dedupe.ConfirmTx(ctx, t.tx) }
func (t *pgxTxn) commit(ctx context.Context) error  { return t.tx.Commit(ctx) }

// call runs fn with the outbox bound to the transaction, bound at the first
// call.
func (t *pgxTxn) call(ctx context.Context, msg *message.Message) error {
	if err := t.bindOutbox(); err != nil {
		return err
	}
	return t.fn(ctx, t.tx, msg, inContext(ctx, t.out))
}

// callBatch runs the batch function (NewPgxBatchTxHandler).
func (t *pgxTxn) callBatch(ctx context.Context, msgs []*message.Message) error {
	if err := t.bindOutbox(); err != nil {
		return err
	}
	return t.batchFn(ctx, t.tx, msgs, inContext(ctx, t.out))
}

// bindOutbox binds the outbox to the transaction once.
func (t *pgxTxn) bindOutbox() error {
	if t.cfg.Outbox == nil {
		return nil
	}
	return t.bind(func() (message.Publisher, error) { return t.cfg.Outbox.TxPublisher(t.tx) })
}

// probe asks pgx, which closes a connection on any failure of its I/O or a
// FATAL error from the server, without a round trip.
func (t *pgxTxn) probe(context.Context) error {
	if t.tx.Conn().IsClosed() {
		return pgconn.ErrConnClosed
	}
	return nil
}

func (t *pgxTxn) rollback(ctx context.Context) error {
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

// HandlePgxTx is HandleTx on pgx: it adds a transactional handler whose
// function receives a pgx.Tx (see NewPgxTxHandler). store must be a PgxStore
// on cfg.DB's database; nil means Config.Store, which must then be one.
func (p *Pipeline) HandlePgxTx(name, topic string, sub message.Subscriber, store *dedupe.SQLStore[pgx.Tx], cfg PgxTxConfig, fn PgxTxFunc) (Handlers, error) {
	return p.handlePgxTx("HandlePgxTx", name, topic, sub, store, cfg, func(cfg PgxTxConfig) (message.NoPublishHandlerFunc, error) {
		return NewPgxTxHandler(cfg, fn)
	})
}

// handlePgxTx adds a pgx transactional handler built by build from cfg,
// completed with the pipeline's store, key and busy delay.
func (p *Pipeline) handlePgxTx(method, name, topic string, sub message.Subscriber, store *dedupe.SQLStore[pgx.Tx], cfg PgxTxConfig, build func(PgxTxConfig) (message.NoPublishHandlerFunc, error)) (Handlers, error) {
	var s dedupe.Store = p.cfg.Store
	if store != nil {
		s = store
	}
	pgxStore, ok := s.(*dedupe.SQLStore[pgx.Tx])
	if !ok {
		return nil, fmt.Errorf("pipeline: %s %q needs a *dedupe.SQLStore[pgx.Tx], got %T", method, name, s)
	}
	if store != nil {
		if err := checkStore(store); err != nil {
			return nil, err
		}
	}
	if cfg.BusyDelay == 0 {
		cfg.BusyDelay = p.cfg.BusyDelay
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = p.cfg.storeTimeout()
	}
	if cfg.Outbox != nil {
		// As HandleTx: a missing outbox table is one clear error now, not
		// a failure of every delivery later.
		err := checkNow(func(ctx context.Context) error { return cfg.Outbox.Check(ctx) })
		if err != nil {
			return nil, fmt.Errorf("pipeline: %s %q: PgxTxConfig.Outbox: %w", method, name, err)
		}
	}
	return p.addTx(name, topic, sub, s, txSetup{
		batch: &cfg.Batch, oneStatement: &cfg.OneStatement, key: &cfg.Key,
		setStore: func() { cfg.Store = pgxStore },
		build:    func() (message.NoPublishHandlerFunc, error) { return build(cfg) },
	})
}

// TypedPgxTx adapts fn to a PgxTxFunc that decodes each payload first, as
// TypedTx does for a TxFunc.
func TypedPgxTx[T any](codec Codec, fn func(ctx context.Context, tx pgx.Tx, m Message[T], out message.Publisher) error) PgxTxFunc {
	return func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
		m, err := Decode[T](codec, msg)
		if err != nil {
			return err
		}
		return fn(ctx, tx, m, out)
	}
}
