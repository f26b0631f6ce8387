package pipeline

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"
)

// inContext returns out as given to a handler running in ctx: each message
// it publishes without a trace of its own gets ctx (the delivery's span and
// settlement), so that the outbox's create span, and the trace context it
// writes into the row, continue the handler's trace instead of starting a
// new one.
func inContext(ctx context.Context, out message.Publisher) message.Publisher {
	if out == nil {
		return nil
	}
	return contextPublisher{Publisher: out, ctx: ctx}
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
