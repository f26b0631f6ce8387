package outbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/telemetry"
)

// The outbox's spans, in the trace of the code that published:
//
//	create <topic>   producer: the message written into the outbox table
//	send <topic>     producer: the relay publishing it to the broker
//
// Each span's context is written into the message's metadata, so the
// consumer's process span is a child of the relay's send span, which is a
// child of the create span. Message IDs, topics and error texts are cleaned
// (valid UTF-8, bounded) before they become span data.

// messagingSystem is messaging.system on the outbox's own spans.
const messagingSystem = "settle_outbox"

func (o *core) tracer() trace.Tracer {
	return o.tel.TracerProvider.Tracer(telemetry.OutboxScope, trace.WithSchemaURL(semconv.SchemaURL))
}

// startCreate starts the span of writing msg into the outbox and writes its
// context into msg's metadata.
func (o *core) startCreate(topic string, msg *message.Message) trace.Span {
	return o.startProducer(msg.Context(), "create", semconv.MessagingOperationTypeCreate, topic, msg, handlerOf(msg.Context()))
}

// startProducer starts the outbox's producer span of operation op (its
// operation type opType) on msg to topic, under parent, with the attributes
// extra first, and writes the span's context into msg's metadata.
func (o *core) startProducer(parent context.Context, op string, opType attribute.KeyValue, topic string, msg *message.Message, extra []attribute.KeyValue) trace.Span {
	ctx, span := o.tracer().Start(parent, op+" "+telemetry.ID(topic),
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(extra...),
		trace.WithAttributes(
			semconv.MessagingSystemKey.String(messagingSystem),
			opType,
			semconv.MessagingOperationName(op),
			semconv.MessagingDestinationName(telemetry.ID(topic)),
			telemetry.MessageID(msg.UUID),
			attribute.String("settle.outbox.topic", o.cfg.Topic),
		))
	o.tel.Propagator.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	return span
}

// handlerOf returns the settle.handler attribute of the delivery whose
// handler publishes (a transactional handler writing to the outbox), or none.
func handlerOf(ctx context.Context) []attribute.KeyValue {
	for _, kv := range settlement.FromContext(ctx).Attributes() {
		if kv.Key == "settle.handler" {
			return []attribute.KeyValue{kv}
		}
	}
	return nil
}

// traced wraps the relay's output publisher: each forwarded message is sent
// inside a span whose parent is the context in its metadata.
func (o *core) traced(out message.Publisher) message.Publisher {
	return &tracedPublisher{Publisher: out, o: o}
}

type tracedPublisher struct {
	message.Publisher
	o *core
}

func (p *tracedPublisher) Publish(topic string, msgs ...*message.Message) error {
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		parent := p.o.tel.Propagator.Extract(context.Background(), propagation.MapCarrier(m.Metadata))
		spans[i] = p.o.startProducer(parent, "send", semconv.MessagingOperationTypeSend, topic, m, nil)
	}
	err := p.Publisher.Publish(topic, msgs...)
	endSpans(spans, err)
	return err
}

// endSpans ends the spans of one publish, recording its error on each.
func endSpans(spans []trace.Span, err error) {
	for _, s := range spans {
		if err != nil {
			telemetry.RecordError(s, err)
		}
		s.End()
	}
}
