package settle

import (
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/internal/telemetry"
)

// Option configures settle's OpenTelemetry instrumentation, in the shape of
// otelhttp's options. The same options are taken everywhere settle makes
// spans or metrics: middleware.NewTracing, pipeline.Config.Tracing and
// outbox.Config.Tracing. A piece ignores an option that means nothing to it
// (each says which); a nil Option is skipped. Only the functions of this
// package make Options.
type Option = telemetry.Option

// WithTracerProvider sets the tracer provider. Nil means the global one
// (otel.GetTracerProvider, as it is when the piece is built).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) {
		if tp != nil {
			c.TracerProvider = tp
		}
	})
}

// WithMeterProvider sets the meter provider. Nil means the global one
// (otel.GetMeterProvider, as it is when the piece is built).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) {
		if mp != nil {
			c.MeterProvider = mp
		}
	})
}

// WithPropagators sets how trace context is read from and written to
// message metadata. Nil means the global propagator once the application
// has set one (otel.SetTextMapPropagator), and W3C Trace Context and
// Baggage while it is OTel's no-op default, so that a program that sets
// none still gets one trace from producer to consumer.
func WithPropagators(p propagation.TextMapPropagator) Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) {
		if p != nil {
			c.Propagator = p
		}
	})
}

// WithMessagingSystem sets messaging.system ("rabbitmq", "gochannel", ...)
// on the tracing middleware's spans. Defaults to "watermill". "" means the
// default.
func WithMessagingSystem(system string) Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) {
		if system != "" {
			c.System = system
		}
	})
}

// WithLinkToProducer makes the producer's context (read from the message's
// metadata) a link of the tracing middleware's process span, which then
// starts a new trace. By default it is the parent, so that the producer, the
// outbox relay, the consumer's processing and its settlement form one trace
// in Jaeger: the conventions allow the parent for single-message processing,
// and prefer links for batches, which Watermill routers do not have.
func WithLinkToProducer() Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) { c.Link = true })
}

// WithSettleWait bounds how long the tracing middleware's settle span waits
// for the router to ack or nack a delivery whose output the router
// publishes (see middleware.NewTracing); after it the span ends with an
// error. Defaults to 30s; d <= 0 means the default.
func WithSettleWait(d time.Duration) Option {
	return telemetry.OptionFunc(func(c *telemetry.Config) {
		if d > 0 {
			c.SettleWait = d
		}
	})
}
