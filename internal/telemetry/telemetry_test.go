package telemetry_test

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/telemetry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestClean(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, in string
		max      int
		want     string
	}{
		{"valid and short is kept", "order-17", 256, "order-17"},
		{"invalid bytes replaced", "a\xff\xfeb\xc3(", 256, "a\uFFFDb\uFFFD("},
		{"cut with an ellipsis", strings.Repeat("x", 20), 10, strings.Repeat("x", 7) + "…"},
		{"cut at a rune boundary", "ééééé", 8, "éé…"},
		{"replaced then cut", "\xff\xff" + strings.Repeat("x", 20), 10, "\uFFFDxxxx…"},
		{"empty", "", 10, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got := telemetry.Clean(c.in, c.max)
			if got != c.want {
				t.Fatalf("Clean(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
			}
			if !utf8.ValidString(got) || len(got) > c.max {
				t.Fatalf("Clean(%q, %d) = %q: %d bytes, valid %v", c.in, c.max, got, len(got), utf8.ValidString(got))
			}
		})
	}
}

func TestCleanAnyInput(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"\xff", strings.Repeat("\xe2\x82", 3000), strings.Repeat("€", 3000), strings.Repeat("a\x80", 3000)} {
		for _, max := range []int{0, 1, 3, 4, 256, 2048} {
			if got := telemetry.Clean(in, max); !utf8.ValidString(got) || len(got) > max && len(got) > len("…") {
				t.Errorf("Clean(%.10q, %d): %d bytes, valid %v", in, max, len(got), utf8.ValidString(got))
			}
		}
	}
}

// Without otel.SetTextMapPropagator (this test binary never calls it), the
// default propagator writes and reads W3C traceparent.
func TestPropagatorDefaultsToW3C(t *testing.T) {
	t.Parallel()
	p := telemetry.Propagator()
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled,
	})
	carrier := propagation.MapCarrier{}
	p.Inject(trace.ContextWithSpanContext(context.Background(), sc), carrier)
	if carrier.Get("traceparent") == "" {
		t.Fatalf("no traceparent written: %v", carrier)
	}
	got := trace.SpanContextFromContext(p.Extract(context.Background(), carrier))
	if got.TraceID() != sc.TraceID() || got.SpanID() != sc.SpanID() {
		t.Fatalf("extracted %v, want %v", got, sc)
	}
}

// marker is a propagator that writes one field of its own.
type marker struct{}

func (marker) Inject(_ context.Context, c propagation.TextMapCarrier) { c.Set("x-marker", "1") }
func (marker) Extract(ctx context.Context, _ propagation.TextMapCarrier) context.Context {
	return ctx
}
func (marker) Fields() []string { return []string{"x-marker"} }

// Once the application sets a global propagator, settle's default follows
// it, even when it was built before. (Not parallel: it sets the global
// propagator before the parallel tests run; the one it sets writes
// traceparent too, so they still hold.)
func TestPropagatorFollowsTheGlobalOnceSet(t *testing.T) {
	p := telemetry.Propagator() // built while the global one is the no-op
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{9}, SpanID: trace.SpanID{9}, TraceFlags: trace.FlagsSampled})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	before := propagation.MapCarrier{}
	p.Inject(ctx, before)
	if before.Get("x-marker") != "" || before.Get("traceparent") == "" {
		t.Fatalf("before the global propagator is set: %v; want traceparent only", before)
	}
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, marker{}))
	after := propagation.MapCarrier{}
	p.Inject(ctx, after)
	if after.Get("x-marker") != "1" || after.Get("traceparent") == "" {
		t.Fatalf("after the global propagator is set: %v; want its fields", after)
	}
}
