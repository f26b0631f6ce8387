package middleware

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/settlement"
)

// ScopeName is the instrumentation scope of settle's settlement spans and
// metrics.
const ScopeName = "github.com/settle-go/settle/middleware"

// Version is the instrumentation version reported with the scope.
const Version = "0.1.0"

// Attribute keys settle adds to the messaging semantic conventions (semconv
// v1.43.0).
const (
	OutcomeKey  = attribute.Key("settle.outcome")
	AttemptKey  = attribute.Key("settle.attempt")
	HandlerKey  = attribute.Key("settle.handler")
	RetriesKey  = attribute.Key("settle.retries")
	ParkedToKey = attribute.Key("settle.parked_to")
)

// Option configures NewTracing, in the shape of otelhttp's options.
type Option interface{ apply(*tracingConfig) }

type optionFunc func(*tracingConfig)

func (f optionFunc) apply(c *tracingConfig) { f(c) }

type tracingConfig struct {
	tp         trace.TracerProvider
	mp         metric.MeterProvider
	prop       propagation.TextMapPropagator
	system     string
	link       bool
	settleWait time.Duration
}

// WithTracerProvider sets the tracer provider. Nil means the global one.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *tracingConfig) {
		if tp != nil {
			c.tp = tp
		}
	})
}

// WithMeterProvider sets the meter provider. Nil means the global one.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *tracingConfig) {
		if mp != nil {
			c.mp = mp
		}
	})
}

// WithPropagators sets how trace context is read from and written to
// message metadata. Nil means the global propagator (W3C traceparent once
// otel.SetTextMapPropagator is called; settle's examples do).
func WithPropagators(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *tracingConfig) {
		if p != nil {
			c.prop = p
		}
	})
}

// WithMessagingSystem sets messaging.system ("rabbitmq", "gochannel", ...).
// Defaults to "watermill".
func WithMessagingSystem(system string) Option {
	return optionFunc(func(c *tracingConfig) {
		if system != "" {
			c.system = system
		}
	})
}

// WithLinkToProducer makes the producer's context (read from the message's
// metadata) a link of the process span, which then starts a new trace. By
// default it is the parent, so that the producer, the outbox relay, the
// consumer's processing and its settlement form one trace in Jaeger: the
// conventions allow the parent for single-message processing, and prefer
// links for batches, which Watermill routers do not have.
func WithLinkToProducer() Option {
	return optionFunc(func(c *tracingConfig) { c.link = true })
}

// WithSettleWait bounds how long a settle span waits for the router to ack
// or nack; after it the span ends with an error. Defaults to 30s.
func WithSettleWait(d time.Duration) Option {
	return optionFunc(func(c *tracingConfig) {
		if d > 0 {
			c.settleWait = d
		}
	})
}

type tracing struct {
	cfg       tracingConfig
	mattrs    sync.Map // metricKey -> metric.MeasurementOption, built once per outcome and handler
	consumer  trace.SpanStartOption
	client    trace.SpanStartOption
	tracer    trace.Tracer
	settled   metric.Int64Counter
	duration  metric.Float64Histogram
	retries   metric.Int64Counter
	systemKV  attribute.KeyValue
	scopeOpts []trace.SpanStartOption
}

// NewTracing returns the settlement tracing middleware. It must be the
// outermost of settle's middleware: it records how each delivery settled.
//
// Per delivery it makes a consumer span "<topic> process" (messaging
// semantic conventions v1.43.0, plus settle.outcome, settle.attempt,
// settle.handler), whose parent is the producer's context read from the
// message's metadata, and a client span "ack <topic>" or "nack <topic>"
// (operation type settle) that ends when the router has really acked or
// nacked the message, not when the middleware returned. Dead-letter and
// poison copies get producer spans "send <topic>" under the process span.
// The process span has error status only when the handler really failed
// (retry, dead_lettered, poisoned), never for a duplicate or a deferral.
//
// Metrics: settle.settlements (by outcome and handler), settle.handler.duration
// (seconds) and settle.retries (in-process retries).
func NewTracing(opts ...Option) (message.HandlerMiddleware, error) {
	cfg := tracingConfig{system: "watermill", settleWait: 30 * time.Second}
	for _, o := range opts {
		o.apply(&cfg)
	}
	if cfg.tp == nil {
		cfg.tp = otel.GetTracerProvider()
	}
	if cfg.mp == nil {
		cfg.mp = otel.GetMeterProvider()
	}
	if cfg.prop == nil {
		cfg.prop = otel.GetTextMapPropagator()
	}
	t := &tracing{
		cfg:      cfg,
		tracer:   cfg.tp.Tracer(ScopeName, trace.WithInstrumentationVersion(Version), trace.WithSchemaURL(semconv.SchemaURL)),
		systemKV: semconv.MessagingSystemKey.String(cfg.system),
		consumer: trace.WithSpanKind(trace.SpanKindConsumer),
		client:   trace.WithSpanKind(trace.SpanKindClient),
	}
	meter := cfg.mp.Meter(ScopeName, metric.WithInstrumentationVersion(Version), metric.WithSchemaURL(semconv.SchemaURL))
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
	return t.wrap, nil
}

func (t *tracing) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		topic := message.SubscribeTopicFromCtx(orig)
		handler := message.HandlerNameFromCtx(orig)
		start := time.Now()

		producer := trace.SpanContextFromContext(t.cfg.prop.Extract(orig, settle.MetadataCarrier(msg.Metadata)))
		opts := []trace.SpanStartOption{
			t.consumer,
			trace.WithAttributes(
				t.systemKV,
				semconv.MessagingDestinationName(topic),
				semconv.MessagingMessageID(msg.UUID),
				semconv.MessagingOperationTypeProcess,
				semconv.MessagingOperationName("process"),
				HandlerKey.String(handler),
			),
		}
		parent := orig
		if producer.IsValid() {
			if t.cfg.link {
				opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}), trace.WithNewRoot())
			} else {
				parent = trace.ContextWithRemoteSpanContext(orig, producer)
			}
		}
		ctx, span := t.tracer.Start(parent, spanName(topic, "process"), opts...)
		ctx, rec := settlement.New(ctx, t.cfg.prop)
		msg.SetContext(ctx)

		var (
			out []*message.Message
			err error
		)
		func() {
			defer func() {
				if p := recover(); p != nil {
					err = &PanicError{Value: p}
					t.finish(msg, span, rec, handler, topic, start, err)
					msg.SetContext(orig)
					panic(p)
				}
			}()
			out, err = h(msg)
		}()
		t.finish(msg, span, rec, handler, topic, start, err)
		msg.SetContext(orig)
		return out, err
	}
}

func spanName(topic, op string) string {
	if topic == "" {
		return op
	}
	return topic + " " + op
}

// finish decides the outcome, ends the process span and starts the settle
// span that ends on the router's ack or nack.
func (t *tracing) finish(msg *message.Message, span trace.Span, rec *settlement.Record, handler, topic string, start time.Time, err error) {
	o, retries, parkedTo, reason := rec.Snapshot()
	outcome := settle.Outcome(o)
	switch {
	case err == nil && outcome == "":
		outcome = settle.Done
	case err != nil && outcome != settle.Deferred && outcome != settle.Retry:
		outcome = settle.Retry
	}
	attrs := []attribute.KeyValue{OutcomeKey.String(string(outcome)), RetriesKey.Int(retries)}
	if n, aerr := strconv.Atoi(msg.Metadata.Get(settle.MetaAttempt)); aerr == nil {
		attrs = append(attrs, AttemptKey.Int(n))
	}
	if parkedTo != "" {
		attrs = append(attrs, ParkedToKey.String(parkedTo))
	}
	span.SetAttributes(attrs...)
	switch outcome {
	case settle.Retry:
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	case settle.DeadLettered, settle.Poisoned:
		if reason != nil {
			span.RecordError(reason)
			span.SetStatus(codes.Error, reason.Error())
		} else {
			span.SetStatus(codes.Error, string(outcome))
		}
	}
	if err != nil && errors.Is(err, context.Canceled) {
		span.SetAttributes(attribute.Bool("settle.cancelled", true))
	}
	span.End()
	end := time.Now()

	ctx := msg.Context()
	mattrs := t.metricAttrs(outcome, handler)
	t.settled.Add(ctx, 1, mattrs)
	t.duration.Record(ctx, end.Sub(start).Seconds(), mattrs)
	if retries > 0 {
		t.retries.Add(ctx, int64(retries), t.metricAttrs("", handler))
	}

	op := "ack"
	if err != nil {
		op = "nack"
	}
	name := op
	if topic != "" {
		name = op + " " + topic
	}
	_, settleSpan := t.tracer.Start(trace.ContextWithSpan(ctx, span), name,
		t.client,
		trace.WithAttributes(
			t.systemKV,
			semconv.MessagingDestinationName(topic),
			semconv.MessagingMessageID(msg.UUID),
			semconv.MessagingOperationTypeSettle,
			semconv.MessagingOperationName(op),
			OutcomeKey.String(string(outcome)),
		))
	go t.awaitSettlement(msg, settleSpan, op)
}

type metricKey struct {
	outcome settle.Outcome
	handler string
}

// metricAttrs returns the measurement option for an outcome (or none) and a
// handler, built once: attribute sets are sorted and hashed when made.
func (t *tracing) metricAttrs(o settle.Outcome, handler string) metric.MeasurementOption {
	k := metricKey{o, handler}
	if v, ok := t.mattrs.Load(k); ok {
		return v.(metric.MeasurementOption)
	}
	kvs := []attribute.KeyValue{HandlerKey.String(handler)}
	if o != "" {
		kvs = append(kvs, OutcomeKey.String(string(o)))
	}
	v, _ := t.mattrs.LoadOrStore(k, metric.WithAttributeSet(attribute.NewSet(kvs...)))
	return v.(metric.MeasurementOption)
}

// awaitSettlement ends the settle span when the router acks or nacks.
func (t *tracing) awaitSettlement(msg *message.Message, span trace.Span, decided string) {
	timer := time.NewTimer(t.cfg.settleWait)
	defer timer.Stop()
	select {
	case <-msg.Acked():
		if decided != "ack" {
			span.SetAttributes(attribute.String("settle.router_decision", "ack"))
		}
	case <-msg.Nacked():
		if decided != "nack" {
			span.SetAttributes(attribute.String("settle.router_decision", "nack"))
			span.SetStatus(codes.Error, "the router nacked a message the middleware settled as ack (publishing its produced messages failed?)")
		}
	case <-timer.C:
		span.SetStatus(codes.Error, "not acked or nacked within "+t.cfg.settleWait.String())
	}
	span.End()
}
