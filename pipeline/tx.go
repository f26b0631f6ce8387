package pipeline

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
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
}

// Validate reports the first invalid field.
func (c TxConfig) Validate() error {
	if c.DB == nil {
		return errors.New("pipeline: TxConfig.DB is required")
	}
	if c.OneStatement && c.Store == nil {
		return errors.New("pipeline: TxConfig.Store is required with OneStatement")
	}
	return nil
}

// NewTxHandler returns a handler that runs fn in a transaction and commits
// the handler's writes, its outbox messages and the dedupe confirmation of
// the message's key together, or none of them. It must sit behind the dedupe
// middleware with a dedupe.SQLStore on the same database:
//
//	dd, _ := dedupe.NewMiddleware(dedupe.Config{Store: store})
//	h, _ := pipeline.NewTxHandler(pipeline.TxConfig{DB: db, Outbox: ob}, charge)
//	router.AddConsumerHandler("charge", "orders", sub, noPublish(h)).AddMiddleware(dd)
//
// The flow of one delivery: the middleware claims the key (outside the
// transaction, so the attempt count survives rollbacks and crashes); the
// handler begins a transaction, calls fn, confirms the claim inside the
// transaction and commits. The commit's error is the handler's result: a
// failed commit releases the claim and the message is retried; a successful
// one makes every later delivery of the key a duplicate. The effect inside the
// database happens exactly once.
func NewTxHandler(cfg TxConfig, fn TxFunc) (message.HandlerFunc, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("pipeline: NewTxHandler: fn is nil")
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		return nil, RunTx(msg.Context(), cfg, msg, fn)
	}, nil
}

// RunTx runs one message through fn in a transaction, as the handler of
// NewTxHandler does. ctx must carry the dedupe middleware's claim.
func RunTx(ctx context.Context, cfg TxConfig, msg *message.Message, fn TxFunc) (err error) {
	tx, err := cfg.DB.BeginTx(ctx, cfg.TxOptions)
	if err != nil {
		return fmt.Errorf("pipeline: begin: %w", err)
	}
	defer func() {
		if err != nil {
			if rerr := tx.Rollback(); rerr != nil && !errors.Is(rerr, sql.ErrTxDone) {
				err = errors.Join(err, fmt.Errorf("pipeline: rollback: %w", rerr))
			}
		}
	}()
	if cfg.OneStatement {
		done, err := claimInTx(ctx, cfg, tx, msg)
		if err != nil || done {
			if done { // a duplicate: nothing to do, nothing to commit
				_ = tx.Rollback()
			}
			return err
		}
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
	keyFn := cfg.Key
	if keyFn == nil {
		keyFn = dedupe.MessageUUID
	}
	key, err := keyFn(msg)
	if err != nil {
		return false, fmt.Errorf("pipeline: key of message %s: %w", msg.UUID, err)
	}
	c, err := cfg.Store.WithTx(tx).ClaimConfirmed(ctx, key)
	if err != nil {
		return false, err
	}
	switch c.Result {
	case dedupe.Duplicate:
		settle.SettlementFromContext(ctx).SetOutcome(settle.Duplicate)
		return true, nil
	case dedupe.Busy:
		settle.SettlementFromContext(ctx).SetOutcome(settle.Deferred)
		return false, fmt.Errorf("%w (message %s)", dedupe.ErrBusy, msg.UUID)
	}
	return false, nil
}
