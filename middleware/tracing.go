package middleware

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/telemetry"
)

// Attribute keys settle adds to the messaging semantic conventions (semconv
// v1.43.0). docs/tracing.md lists them.
const (
	outcomeKey  = attribute.Key("settle.outcome")
	attemptKey  = attribute.Key("settle.attempt")
	handlerKey  = attribute.Key("settle.handler")
	retriesKey  = attribute.Key("settle.retries")
	parkedToKey = attribute.Key("settle.parked_to")
	// settledKey is what the router did with the delivery, on its process
	// span: "ack" or "nack".
	settledKey = attribute.Key("settle.settled")
	// routerDecisionKey marks a settlement other than the one the
	// middleware decided.
	routerDecisionKey = attribute.Key("settle.router_decision")
)

// Defaults of the options NewTracing reads.
const (
	defaultSystem     = "watermill"
	defaultSettleWait = 30 * time.Second
)

type tracing struct {
	cfg      telemetry.Config
	mattrs   sync.Map // metricKey -> *measurement, built once per outcome and handler
	names    sync.Map // deliveryKey -> *spanNames, built once per handler and topic
	consumer trace.SpanStartOption
	client   trace.SpanStartOption
	tracer   trace.Tracer
	settled  metric.Int64Counter
	duration metric.Float64Histogram
	retries  metric.Int64Counter
	leftOut  metric.Int64Counter // parked copies without their payload
	producer trace.SpanStartOption
	systemKV attribute.KeyValue
	warned   atomic.Bool // the missing TracePublished was reported
}

// NewTracing returns the settlement tracing middleware. It must be the
// outermost of settle's middleware: it records how each delivery settled.
//
// Span names follow the messaging semantic conventions (v1.43.0),
// "{operation} {destination}". Per delivery it makes:
//
//   - a consumer span "process <topic>" (operation type process, plus
//     settle.outcome, settle.attempt), whose parent is the producer's
//     context read from the message's metadata. It ends at the
//     settlement and records it: settle.settled is "ack" or "nack", what
//     the router does with the message (see below for when it ends). A
//     plainly acked delivery is this one span;
//   - a client span "nack <topic>" (operation type settle, with
//     settle.outcome) under it when the router nacks the message, so that
//     a delivery handed back to the broker shows as such;
//   - a client span "ack <topic>" (operation type settle) under it only
//     when the router publishes the messages the chain returned: it shows
//     the wait for that publish, from the chain's return to the settlement;
//   - a producer span "create <topic>" under it for each message the handler
//     returns, whose context is written into that message's metadata, so
//     the consumers of the handler's output continue the same trace (see
//     TraceProduced when the output is published inside the chain);
//   - a producer span "send <topic>" under it for a dead-letter or poison
//     copy, whose context the copy carries;
//   - an internal span "park <topic>" under it for the row a parked-message
//     store (ParkConfig.Store) writes of a dead-lettered or poisoned
//     message, with settle.outcome and, when the row could not be written,
//     error status.
//
// Every one of them has messaging.system, messaging.destination.name,
// messaging.message.id and settle.handler; on a create or send span the
// destination and the message ID are those of the message it sends.
// The process span has error status only when the handler really failed
// (retry, dead_lettered, poisoned), never for a duplicate or a deferral.
// What comes from a message (its ID, the error text of a failed run) is
// made valid UTF-8 and bounded (256 bytes for IDs, 2 KiB for texts) before
// it becomes span data: an OTLP exporter refuses a whole batch for one
// string that is not valid UTF-8.
//
// When the tracer provider's sampler drops a process span, it ends when the
// middleware returns, no ack or nack span is started under it (it would be dropped with it, or an orphan), and
// the process span gets no outcome attributes; the metrics still count the
// settlement.
//
// Metrics: settle.settlements (by outcome and handler), settle.handler.duration
// (seconds) and settle.retries (in-process retries).
//
// The process span, and the ack or nack span under it if any, end before
// the router acks or nacks, on the delivery's own goroutine, which
// router.Close waits for: so a tracer provider shut down right after Close
// exports them. When the chain returns an error (the router nacks) or no
// messages for the router to publish (it acks), nothing is left for the
// router to decide, and the spans end before the middleware returns. When
// the router still has to publish messages the chain returned, they end
// when that publish returns (the router then acks, or nacks if it failed),
// provided the router has TracePublished among its publisher decorators:
//
//	router.AddPublisherDecorators(middleware.TracePublished)
//
// Without it, such spans end when the router acks or nacks, on a goroutine
// of that delivery (or after the settle wait), which can be just after Close
// returns; the middleware then reports the missing decorator once to the
// OpenTelemetry error handler. A middleware inside this one that publishes
// the output itself (dedupe.Config.Publisher, as pipeline does) leaves the
// router nothing to publish and needs no decorator.
// A middleware outside this one that changes what the chain returns is not
// seen: settle.settled names what the chain returned.
func NewTracing(opts ...settle.Option) (message.HandlerMiddleware, error) {
	cfg := telemetry.Resolve(opts)
	if cfg.System == "" {
		cfg.System = defaultSystem
	}
	if cfg.SettleWait == 0 {
		cfg.SettleWait = defaultSettleWait
	}
	t := &tracing{
		cfg:      cfg,
		tracer:   cfg.TracerProvider.Tracer(telemetry.MiddlewareScope, trace.WithInstrumentationVersion(telemetry.Version), trace.WithSchemaURL(semconv.SchemaURL)),
		systemKV: semconv.MessagingSystemKey.String(cfg.System),
		consumer: trace.WithSpanKind(trace.SpanKindConsumer),
		client:   trace.WithSpanKind(trace.SpanKindClient),
		producer: trace.WithSpanKind(trace.SpanKindProducer),
	}
	meter := cfg.MeterProvider.Meter(telemetry.MiddlewareScope, metric.WithInstrumentationVersion(telemetry.Version), metric.WithSchemaURL(semconv.SchemaURL))
	var err error
	if t.settled, err = meter.Int64Counter("settle.settlements", metric.WithDescription("Deliveries settled, by outcome and handler."), metric.WithUnit("{delivery}")); err != nil {
		return nil, err
	}
	if t.duration, err = meter.Float64Histogram("settle.handler.duration", metric.WithDescription("Time from receiving a delivery to deciding its settlement."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if t.retries, err = meter.Int64Counter("settle.retries", metric.WithDescription("In-process retries of failed handler runs."), metric.WithUnit("{retry}")); err != nil {
		return nil, err
	}
	if t.leftOut, err = meter.Int64Counter("settle.park.payloads_left_out", metric.WithDescription("Parked copies published without their payload, which left no room for settle's metadata within the broker's bound on one message."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	return t.wrap, nil
}

func (t *tracing) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		d := t.spanNames(message.HandlerNameFromCtx(orig), message.SubscribeTopicFromCtx(orig))
		start := time.Now()

		producer := trace.SpanContextFromContext(t.cfg.Propagator.Extract(orig, propagation.MapCarrier(msg.Metadata)))
		attrs := make([]attribute.KeyValue, 0, len(d.ids)+4)
		attrs = append(attrs, d.ids...)
		attrs = append(attrs,
			d.destination,
			telemetry.MessageID(msg.UUID),
			semconv.MessagingOperationTypeProcess,
			operationProcess,
		)
		opts := make([]trace.SpanStartOption, 0, 4)
		opts = append(opts, t.consumer, trace.WithAttributes(attrs...))
		parent := orig
		if producer.IsValid() {
			if t.cfg.Link {
				opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}), trace.WithNewRoot())
			} else {
				parent = trace.ContextWithRemoteSpanContext(orig, producer)
			}
		}
		pctx, span := t.tracer.Start(parent, d.process, opts...)
		ctx, rec := settlement.New(pctx, t.cfg.Propagator)
		rec.SpanAttributes = d.ids
		var out *output
		if pub := message.PublishTopicFromCtx(orig); pub != "" {
			// Only a handler with a publish topic has output to trace.
			out = &output{t: t, ctx: ctx, ids: d.ids, topic: pub}
			ctx = context.WithValue(ctx, outputKey{}, out)
		}
		msg.SetContext(ctx)

		var (
			produced []*message.Message
			err      error
		)
		func() {
			defer func() {
				if p := recover(); p != nil {
					err = &PanicError{Value: p}
					t.finish(msg, pctx, span, rec, d, start, err, nil, false)
					msg.SetContext(orig)
					panic(p)
				}
			}()
			produced, err = h(msg)
		}()
		if err == nil && out != nil {
			// The router publishes what the chain returns after this
			// middleware returns: give each message its create span now.
			out.trace(produced)
		}
		t.finish(msg, pctx, span, rec, d, start, err, produced, out != nil)
		msg.SetContext(orig)
		return produced, err
	}
}

var (
	operationProcess = semconv.MessagingOperationName("process")
	operationAck     = semconv.MessagingOperationName("ack")
	operationNack    = semconv.MessagingOperationName("nack")
)

// deliveryKey names the deliveries of one router handler on one topic.
type deliveryKey struct{ handler, topic string }

// spanNames is what the spans of every delivery of one handler on one topic
// share, built once: span names and attributes are the same for all.
type spanNames struct {
	// published says that TracePublished has seen the router publish the
	// output of a delivery of this handler: its settle spans are ended
	// there, and no goroutine need wait for the router's ack or nack.
	published atomic.Bool

	handler, topic     string
	process, ack, nack string               // span names
	ids                []attribute.KeyValue // messaging.system, settle.handler; full, so that an append copies
	destination        attribute.KeyValue
}

func (t *tracing) spanNames(handler, topic string) *spanNames {
	k := deliveryKey{handler, topic}
	if v, ok := t.names.Load(k); ok {
		return v.(*spanNames)
	}
	// Names come from the router's configuration, not from messages, but
	// they end up in every span and metric: clean them once here.
	handler, topic = telemetry.ID(handler), telemetry.ID(topic)
	ids := []attribute.KeyValue{t.systemKV, handlerKey.String(handler)}
	d := &spanNames{
		handler: handler, topic: topic,
		process: spanName("process", topic), ack: spanName("ack", topic), nack: spanName("nack", topic),
		ids:         ids[:len(ids):len(ids)],
		destination: semconv.MessagingDestinationName(topic),
	}
	v, _ := t.names.LoadOrStore(k, d)
	return v.(*spanNames)
}

// spanName is "{operation} {destination}", or the operation alone when the
// destination is unknown.
func spanName(op, topic string) string {
	if topic == "" {
		return op
	}
	return op + " " + topic
}

type outputKey struct{}

// output gives the messages a handler produces in one delivery their create
// spans, once each, whichever of TraceProduced and the tracing middleware
// sees them first.
type output struct {
	t     *tracing
	ctx   context.Context // the process span's
	ids   []attribute.KeyValue
	topic string // the handler's publish topic

	mu   sync.Mutex
	done map[*message.Message]struct{}
}

func (o *output) trace(msgs []*message.Message) {
	if len(msgs) == 0 {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, m := range msgs {
		if m == nil {
			continue
		}
		if _, ok := o.done[m]; ok {
			continue
		}
		if o.done == nil {
			o.done = make(map[*message.Message]struct{}, len(msgs))
		}
		o.done[m] = struct{}{}
		ctx, span := o.t.tracer.Start(o.ctx, spanName("create", telemetry.ID(o.topic)),
			o.t.producer,
			trace.WithAttributes(o.ids...),
			trace.WithAttributes(
				semconv.MessagingDestinationName(telemetry.ID(o.topic)),
				telemetry.MessageID(m.UUID),
				semconv.MessagingOperationTypeCreate,
				semconv.MessagingOperationName("create"),
			))
		o.t.cfg.Propagator.Inject(ctx, propagation.MapCarrier(m.Metadata))
		if !trace.SpanContextFromContext(m.Context()).IsValid() {
			// A publisher that traces by the message's context (settle's
			// outbox) continues from the create span too.
			m.SetContext(trace.ContextWithSpan(m.Context(), span))
		}
		span.End()
	}
}

// TraceProduced is middleware that writes the trace context of the tracing
// middleware's process span into each message the handler returns, under a
// "create <publish topic>" span, so that their consumers continue the trace.
// The tracing middleware does this itself for messages the router publishes;
// TraceProduced is needed only when a middleware between the two publishes
// the handler's output itself (dedupe.Config.Publisher does, before it
// confirms the key): add it innermost, right around the handler. pipeline
// does. Without the tracing middleware outside it, it does nothing.
func TraceProduced(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		produced, err := h(msg)
		if err == nil {
			if o, ok := msg.Context().Value(outputKey{}).(*output); ok {
				o.trace(produced)
			}
		}
		return produced, err
	}
}

// finish decides the outcome, ends the process span and makes the settle
// span. pctx carries the process span. produced is what the chain returned
// for the router to publish; publishes says that the router handler has a
// publisher.
func (t *tracing) finish(msg *message.Message, pctx context.Context, span trace.Span, rec *settlement.Record, d *spanNames, start time.Time, err error, produced []*message.Message, publishes bool) {
	o, retries, parkedTo, reason := rec.Snapshot()
	outcome := settle.Outcome(o)
	switch {
	case err == nil && outcome == "":
		outcome = settle.Done
	case err != nil && outcome != settle.Deferred && outcome != settle.Retry:
		outcome = settle.Retry
	}
	// A span the sampler dropped records nothing: none of its attributes
	// are built, and no settle span is started under it (see below).
	recording := span.IsRecording()
	s := settling{msg: msg, process: span, decided: "ack"}
	if err != nil {
		s.decided = "nack"
	}
	// awaits: the router publishes the handler's output after this
	// middleware returns, then acks, or nacks when publishing failed.
	// Otherwise the settlement is known now.
	awaits := err == nil && len(produced) > 0 && publishes && !s.settled()
	routerAcks := err == nil && len(produced) == 0
	acked := s.acks(routerAcks)
	if recording {
		attrs := make([]attribute.KeyValue, 0, 5)
		attrs = append(attrs, outcomeKey.String(string(outcome)), retriesKey.Int(retries))
		if !awaits {
			s.recorded = true
			attrs = append(attrs, settledKey.String(settledName(acked)))
		}
		if n, aerr := strconv.Atoi(msg.Metadata.Get(settle.MetaAttempt)); aerr == nil {
			attrs = append(attrs, attemptKey.Int(n))
		}
		if parkedTo != "" {
			attrs = append(attrs, parkedToKey.String(telemetry.ID(parkedTo)))
		}
		span.SetAttributes(attrs...)
		switch outcome {
		case settle.Retry:
			if err != nil {
				telemetry.RecordError(span, err)
			}
		case settle.DeadLettered, settle.Poisoned:
			if reason != nil {
				telemetry.RecordError(span, reason)
			} else {
				span.SetStatus(codes.Error, string(outcome))
			}
		}
		if err != nil && errors.Is(err, context.Canceled) {
			span.SetAttributes(attribute.Bool("settle.cancelled", true))
		}
	}
	if n, stored := rec.PayloadLeftOut(); n > 0 {
		if recording {
			span.AddEvent("settle.payload_left_out", trace.WithAttributes(
				attribute.Int("settle.payload_bytes", n), attribute.Bool("settle.payload_in_store", stored)))
		}
		t.leftOut.Add(msg.Context(), 1, t.measurement("", d.handler).add...)
	}
	end := time.Now()

	ctx := msg.Context()
	m := t.measurement(outcome, d.handler)
	t.settled.Add(ctx, 1, m.add...)
	t.duration.Record(ctx, end.Sub(start).Seconds(), m.record...)
	if retries > 0 {
		t.retries.Add(ctx, int64(retries), t.measurement("", d.handler).add...)
	}
	if !recording {
		// The sampler dropped the delivery's trace: no child span is
		// started under a span nobody sees (the parent-based samplers drop
		// it too; any other would make it an orphan). The metrics above
		// still count the settlement.
		span.End()
		return
	}

	if awaits {
		// The router publishes the handler's output after this middleware
		// returns, then acks, or nacks when publishing failed: the process
		// span stays open until that publish returns (TracePublished), or
		// else until the router acks or nacks, under a settle span that
		// shows the wait.
		s.span = t.settleSpan(pctx, msg, rec, d, d.ack, operationAck, outcome)
		t.awaitPublish(s, d, produced)
		return
	}
	// Nothing is left for the router to decide: it nacks an error and acks
	// a success at once (and nacks a success with output but no publisher).
	// The spans end here, on the delivery's own goroutine, which
	// router.Close waits for: so they have ended when Close returns, and a
	// tracer provider shut down right after still exports them. A plain
	// ack is told by the process span alone; a nack gets a settle span of
	// its own, so that a message handed back to the broker shows as such.
	if !acked {
		s.span = t.settleSpan(pctx, msg, rec, d, d.nack, operationNack, outcome)
	}
	s.end(acked)
}

// settleSpan starts a delivery's settle span (operation type settle) under
// its process span.
func (t *tracing) settleSpan(pctx context.Context, msg *message.Message, rec *settlement.Record, d *spanNames, name string, op attribute.KeyValue, outcome settle.Outcome) trace.Span {
	ids := rec.Attributes()
	sattrs := make([]attribute.KeyValue, 0, len(ids)+5)
	sattrs = append(sattrs, ids...)
	sattrs = append(sattrs,
		d.destination,
		telemetry.MessageID(msg.UUID),
		semconv.MessagingOperationTypeSettle,
		op,
		outcomeKey.String(string(outcome)),
	)
	_, span := t.tracer.Start(pctx, name, t.client, trace.WithAttributes(sattrs...))
	return span
}

type metricKey struct {
	outcome settle.Outcome
	handler string
}

// measurement is the attribute set of an outcome (or none) and a handler, as
// the options of the two kinds of recording.
type measurement struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

// measurement returns the options for an outcome (or none) and a handler,
// built once: attribute sets are sorted and hashed when made, and the
// option slices passed as they are allocate nothing.
func (t *tracing) measurement(o settle.Outcome, handler string) *measurement {
	k := metricKey{o, handler}
	if v, ok := t.mattrs.Load(k); ok {
		return v.(*measurement)
	}
	kvs := []attribute.KeyValue{handlerKey.String(handler)}
	if o != "" {
		kvs = append(kvs, outcomeKey.String(string(o)))
	}
	opt := metric.WithAttributeSet(attribute.NewSet(kvs...))
	v, _ := t.mattrs.LoadOrStore(k, &measurement{add: []metric.AddOption{opt}, record: []metric.RecordOption{opt}})
	return v.(*measurement)
}
