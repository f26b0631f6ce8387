package pipeline

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

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
}

// Validate reports the first invalid field.
func (c TxConfig) Validate() error {
	if c.DB == nil {
		return errors.New("pipeline: TxConfig.DB is required")
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
	var out message.Publisher
	if cfg.Outbox != nil {
		if out, err = cfg.Outbox.TxPublisher(tx); err != nil {
			return err
		}
	}
	if err = fn(ctx, tx, msg, out); err != nil {
		return err
	}
	if err = dedupe.ConfirmTx(ctx, tx); err != nil {
		return err
	}
	if err = tx.Commit(); err != nil {
		return fmt.Errorf("pipeline: commit: %w", err)
	}
	return nil
}
