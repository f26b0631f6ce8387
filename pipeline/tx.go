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
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/outbox"
)

// TxFunc is a handler that runs in a database transaction. It does its
// writes on tx and publishes its messages on out, the outbox bound to tx (nil
// when TxConfig.Outbox is nil). It must not commit or roll back tx.
type TxFunc func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error

// TxConfig configures a transactional handler.
type TxConfig struct {
	// DB is the database of the handler's writes, the dedupe claims table and
	// the outbox. Required.
	DB *sql.DB
	// Outbox, if set, gives the handler a publisher whose messages commit
	// with its writes.
	Outbox *outbox.Outbox
	// TxOptions are passed to BeginTx. Nil means the driver's default.
	TxOptions *sql.TxOptions
	// OneStatement takes the message's key inside the transaction, written
	// as confirmed at once (dedupe.SQLStore.ClaimConfirmed): one statement
	// per message instead of two, and the handler needs no dedupe middleware.
	// The price: an attempt that rolls back or dies with its process leaves
	// no durable count (count attempts with the broker's delivery count), and
	// a concurrent delivery of the same key waits for the transaction instead
	// of being deferred. Requires Store.
	OneStatement bool
	// Store is the claims table for OneStatement (Pipeline.HandleTx sets it).
	Store *dedupe.SQLStore
	// Key derives the key for OneStatement. Defaults to the message UUID.
	Key dedupe.KeyFunc
	// BusyDelay is how long a delivery whose key another worker holds waits
	// before it is nacked, in OneStatement and Batch modes (the dedupe
	// middleware's own BusyDelay covers the default mode): it is deferred,
	// not an attempt. Defaults to 1s when zero; settle.NoDelay nacks at once.
	// Pipeline.HandleTx sets it from Config.BusyDelay.
	BusyDelay time.Duration
	// Batch turns on group commit: deliveries in flight at the same time
	// share one transaction (see BatchConfig). Their keys are written as
	// confirmed inside it, as with OneStatement, so it requires Store and
	// needs no dedupe middleware.
	Batch BatchConfig
	// Scope names the logical handler of the key for OneStatement, as
	// dedupe.Config.Scope does for the middleware. Defaults to
	// dedupe.HandlerScope.
	Scope dedupe.ScopeFunc
}

// Validate reports the first invalid field.
func (c TxConfig) Validate() error {
	if c.DB == nil {
		return errors.New("pipeline: TxConfig.DB is required")
	}
	if c.OneStatement && c.Store == nil {
		return errors.New("pipeline: TxConfig.Store is required with OneStatement")
	}
	if c.BusyDelay < 0 && c.BusyDelay != settle.NoDelay {
		return fmt.Errorf("pipeline: TxConfig.BusyDelay must be >= 0 or settle.NoDelay, got %v", c.BusyDelay)
	}
	if c.Batch.MaxSize < 0 {
		return fmt.Errorf("pipeline: TxConfig.Batch.MaxSize must be >= 0, got %d", c.Batch.MaxSize)
	}
	if c.Batch.enabled() && c.Store == nil {
		return errors.New("pipeline: TxConfig.Store is required with Batch")
	}
	return nil
}

// NewTxHandler returns a consumer handler that runs fn in a transaction and
// commits the handler's writes, its outbox messages and the dedupe
// confirmation of the message's key together, or none of them. It publishes
// through the outbox, never through the router, so it is a
// message.NoPublishHandlerFunc. It must sit behind the dedupe middleware with
// a dedupe.SQLStore on the same database:
//
//	dd, _ := dedupe.NewMiddleware(dedupe.Config{Store: store})
//	h, _ := pipeline.NewTxHandler(pipeline.TxConfig{DB: db, Outbox: ob}, charge)
//	router.AddConsumerHandler("charge", "orders", sub, h).AddMiddleware(dd)
//
// The flow of one delivery: the middleware claims the key (outside the
// transaction, so the attempt count survives rollbacks and crashes); the
// handler begins a transaction, calls fn, confirms the claim inside the
// transaction and commits. The commit's error is the handler's result: a
// failed commit releases the claim and the message is retried; a successful
// one makes every later delivery of the key a duplicate. The effect inside the
// database happens exactly once.
func NewTxHandler(cfg TxConfig, fn TxFunc) (message.NoPublishHandlerFunc, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("pipeline: NewTxHandler: fn is nil")
	}
	if cfg.Batch.enabled() {
		return newBatcher(cfg, fn, nil).handle, nil
	}
	return func(msg *message.Message) error {
		return RunTx(msg.Context(), cfg, msg, fn)
	}, nil
}

// RunTx runs one message through fn in a transaction, as the handler of
// NewTxHandler does. ctx must carry the dedupe middleware's claim.
//
// The transaction is always ended: committed when fn returns nil, rolled
// back when it returns an error or panics (the panic then goes on, to the
// router's recoverer, and the dedupe middleware releases the claim so the
// message is retried as after any failure).
func RunTx(ctx context.Context, cfg TxConfig, msg *message.Message, fn TxFunc) (err error) {
	tx, err := cfg.DB.BeginTx(ctx, cfg.TxOptions)
	if err != nil {
		return unavailable(ctx, cfg, fmt.Errorf("pipeline: begin: %w", err))
	}
	defer func() {
		// After a commit this is a no-op (sql.ErrTxDone); after an error or
		// a panic it is what frees the transaction's locks.
		if rerr := tx.Rollback(); rerr != nil && !errors.Is(rerr, sql.ErrTxDone) && err != nil {
			err = errors.Join(err, fmt.Errorf("pipeline: rollback: %w", rerr))
		}
	}()
	if cfg.OneStatement {
		done, err := claimInTx(ctx, cfg, tx, msg)
		if errors.Is(err, dedupe.ErrBusy) {
			_ = tx.Rollback() // hold no connection while waiting
			settlement.Sleep(ctx, cfg.busyDelay())
		}
		if err != nil || done {
			return err // a duplicate has nothing to commit: the rollback ends it
		}
	} else if err = dedupe.HoldTx(ctx, tx); err != nil {
		return err
	}
	var out message.Publisher
	if cfg.Outbox != nil {
		if out, err = cfg.Outbox.TxPublisher(tx); err != nil {
			return err
		}
	}
	if err = fn(ctx, tx, msg, out); err != nil {
		return err
	}
	if !cfg.OneStatement {
		if err = dedupe.ConfirmTx(ctx, tx); err != nil {
			return err
		}
	}
	if err = tx.Commit(); err != nil {
		return fmt.Errorf("pipeline: commit: %w", err)
	}
	if cfg.Outbox != nil {
		cfg.Outbox.Notify() // a relay of this process forwards at once
	}
	return nil
}

// claimInTx takes msg's key in tx as confirmed. It reports done for a
// duplicate, and an error wrapping dedupe.ErrBusy for a key held elsewhere.
func claimInTx(ctx context.Context, cfg TxConfig, tx *sql.Tx, msg *message.Message) (done bool, err error) {
	key, err := dedupe.MessageKey(msg, cfg.Key, cfg.Scope)
	if err != nil {
		return false, fmt.Errorf("pipeline: key of message %s: %w", msg.UUID, err)
	}
	c, err := cfg.Store.WithTx(tx).ClaimConfirmed(ctx, key)
	if err != nil {
		return false, unavailable(ctx, cfg, err)
	}
	return claimResult(ctx, c, msg)
}

// claimResult settles what a claim in the transaction found: done for a
// duplicate (acked, nothing to run), an error wrapping dedupe.ErrBusy for a
// key held elsewhere (deferred), neither for an acquired key.
func claimResult(ctx context.Context, c dedupe.Claim, msg *message.Message) (done bool, err error) {
	switch c.Result {
	case dedupe.Duplicate:
		settlement.FromContext(ctx).SetOutcome(settlement.Duplicate)
		return true, nil
	case dedupe.Busy:
		settlement.FromContext(ctx).Defer() // not an attempt
		return false, fmt.Errorf("%w (message %s)", dedupe.ErrBusy, msg.UUID)
	}
	return false, nil
}

// busyDelay is BusyDelay with its default applied.
func (c TxConfig) busyDelay() time.Duration {
	switch c.BusyDelay {
	case 0:
		return time.Second
	case settle.NoDelay:
		return 0
	}
	return c.BusyDelay
}

// unavailable defers a delivery whose transaction could not begin or whose
// key could not be claimed: the database is not answering, and that is not
// an attempt of the handler. It waits BusyDelay first, so that an outage is
// not a hot loop of nacks.
func unavailable(ctx context.Context, cfg TxConfig, err error) error {
	settlement.FromContext(ctx).Defer()
	settlement.Sleep(ctx, cfg.busyDelay())
	return fmt.Errorf("%w: %w", dedupe.ErrUnavailable, err)
}
