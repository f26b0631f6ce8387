package settle_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/telemetry"
)

func TestAttempt(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]int{"": 1, "1": 1, "3": 3, "0": 1, "-2": 1, "x": 1, "12": 12} {
		m := message.NewMessage("m", nil)
		if v != "" {
			m.Metadata.Set(settle.MetaAttempt, v)
		}
		if got := settle.Attempt(m); got != want {
			t.Errorf("Attempt with %q = %d, want %d", v, got, want)
		}
	}
}

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
