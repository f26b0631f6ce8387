package pipeline

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"
)

// publishInContext passes fn an outbox publisher that gives each message
// without a trace of its own the span of the delivery being handled, so that
// the outbox's create span, and the trace context it writes into the row,
// continue the handler's trace instead of starting a new one.
func publishInContext(fn TxFunc) TxFunc {
	return func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
		if out != nil {
			out = contextPublisher{Publisher: out, ctx: ctx}
		}
		return fn(ctx, tx, msg, out)
	}
}

type contextPublisher struct {
	message.Publisher
	ctx context.Context // the delivery's: its span and its settlement
}

func (p contextPublisher) Publish(topic string, msgs ...*message.Message) error {
	if trace.SpanContextFromContext(p.ctx).IsValid() {
		for _, m := range msgs {
			if !trace.SpanContextFromContext(m.Context()).IsValid() {
				m.SetContext(p.ctx)
			}
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}
