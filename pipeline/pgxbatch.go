package pipeline

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
)

// PgxBatchTxFunc is BatchTxFunc on pgx: it handles a batch of messages in one
// pgx transaction. It does its writes on tx and publishes on out, the outbox
// bound to tx (outbox.Outbox.TxPublisher; nil when PgxTxConfig.Outbox is
// nil); it must not commit or roll tx back. msgs holds only messages whose
// work is not done yet. A failure is settled as BatchTxFunc says: an error
// that names its message (MessageFailed) fails that message alone, any other
// error or a panic splits the batch until the failing message is alone.
//
// pgx can send the batch's statements in one round trip (tx.SendBatch with a
// pgx.Batch) or copy its rows (tx.CopyFrom), which database/sql cannot; an
// error from one queued statement of a pgx.Batch does not say which message
// it came from unless the function tells (MessageFailed).
type PgxBatchTxFunc func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error

// NewPgxBatchTxHandler is NewBatchTxHandler on pgx: it gathers the deliveries
// in flight into batches (cfg.Batch, whose MaxSize must be at least 2) and
// runs fn once per batch, in one pgx transaction with the batch's dedupe
// keys (cfg.Store, a dedupe.PgxStore, which writes them in one statement)
// and its outbox messages (cfg.Outbox). Each delivery is settled on its own:
// it is acked after the commit, or fails alone as PgxBatchTxFunc says. The
// batching, the claims and the settlement of each delivery are those of
// NewBatchTxHandler; only the driver differs.
func NewPgxBatchTxHandler(cfg PgxTxConfig, fn PgxBatchTxFunc) (message.NoPublishHandlerFunc, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return newBatchHandler("NewPgxBatchTxHandler", "PgxTxConfig", cfg.Batch, fn == nil, func() txFlow { return cfg.flow(nil, fn) })
}

// HandlePgxBatchTx is HandleBatchTx on pgx: it adds a batch handler (see
// NewPgxBatchTxHandler) whose deliveries in flight, up to cfg.Batch.MaxSize
// (capped at the deliveries the handler can have in flight, see
// Config.Concurrency; there must be at least 2), are handed to fn
// together, and whose writes, outbox messages and dedupe keys commit in one
// pgx transaction. store must be a PgxStore on cfg.DB's database; nil means
// Config.Store, which must then be one.
func (p *Pipeline) HandlePgxBatchTx(name, topic string, sub message.Subscriber, store *dedupe.SQLStore[pgx.Tx], cfg PgxTxConfig, fn PgxBatchTxFunc) (Handlers, error) {
	if err := p.canBatch("HandlePgxBatchTx", "PgxTxConfig", name, sub, cfg.Batch); err != nil {
		return nil, err
	}
	return p.handlePgxTx("HandlePgxBatchTx", name, topic, sub, store, cfg, func(cfg PgxTxConfig) (message.NoPublishHandlerFunc, error) {
		return NewPgxBatchTxHandler(cfg, fn)
	})
}

// TypedPgxBatchTx adapts fn to a PgxBatchTxFunc that decodes every payload
// first, as TypedBatchTx does: a payload that does not decode names its
// message (MessageFailed) with a permanent decode error, so that message is
// poisoned and the rest of the batch runs without it.
func TypedPgxBatchTx[T any](codec Codec, fn func(ctx context.Context, tx pgx.Tx, msgs []Message[T], out message.Publisher) error) PgxBatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
		ms, err := decodeBatch[T](codec, msgs)
		if err != nil {
			return err
		}
		return fn(ctx, tx, ms, out)
	}
}
