package settle_test

import (
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/telemetry"
)

// The options are nil-safe: a nil provider or propagator, an empty system
// and a wait <= 0 leave the default, and a nil Option is skipped.
func TestOptionsNilSafe(t *testing.T) {
	t.Parallel()
	c := telemetry.Resolve([]settle.Option{
		settle.WithTracerProvider(nil), settle.WithMeterProvider(nil), settle.WithPropagators(nil),
		settle.WithMessagingSystem(""), settle.WithSettleWait(-time.Second), nil,
	})
	if c.TracerProvider == nil || c.MeterProvider == nil || c.Propagator == nil {
		t.Fatalf("a nil option left no default: %+v", c)
	}
	if c.System != "" || c.SettleWait != 0 || c.Link {
		t.Fatalf("an empty option set something: %+v", c)
	}
	tp := tracenoop.NewTracerProvider()
	c = telemetry.Resolve([]settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{}),
		settle.WithMessagingSystem("rabbitmq"), settle.WithSettleWait(time.Second), settle.WithLinkToProducer()})
	if c.TracerProvider != tp || c.Propagator != (propagation.TraceContext{}) || c.System != "rabbitmq" || c.SettleWait != time.Second || !c.Link {
		t.Fatalf("options not applied: %+v", c)
	}
}
