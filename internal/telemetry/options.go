package telemetry

import (
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Instrumentation scopes of settle's spans and metrics, and the version
// reported with them.
const (
	MiddlewareScope = "github.com/settle-go/settle/middleware"
	OutboxScope     = "github.com/settle-go/settle/outbox"
	Version         = "0.1.0"
)

// Config is what settle.Option sets. Zero fields are unset.
type Config struct {
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	Propagator     propagation.TextMapPropagator
	System         string        // messaging.system
	Link           bool          // the producer's context is a link, not the parent
	SettleWait     time.Duration // how long a settle span waits for the ack or nack
}

// Option is settle.Option: it can only be made by the functions of package
// settle (the method is unexported), so every option is one settle knows.
type Option interface{ apply(*Config) }

// OptionFunc makes an Option of a function.
type OptionFunc func(*Config)

func (f OptionFunc) apply(c *Config) { f(c) }

// Resolve applies opts (nil ones are skipped) and fills the providers and
// the propagator left unset with the global ones, as they are now (the
// propagator with Propagator's fallback).
func Resolve(opts []Option) Config {
	var c Config
	for _, o := range opts {
		if o != nil {
			o.apply(&c)
		}
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Propagator == nil {
		c.Propagator = Propagator()
	}
	return c
}
