package middleware_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// countPub is a router publisher that only counts its publishes.
type countPub struct{ n *atomic.Int64 }

func (p countPub) Publish(string, ...*message.Message) error { p.n.Add(1); return nil }
func (countPub) Close() error                                { return nil }

// The cost per delivery of a settle span for output the router publishes:
// without TracePublished (a goroutine per delivery waits for the ack), and
// with it (the span ends in the router's publish). Eight handlers on one
// in-process pubsub, so the figure is mostly the pubsub's.
func BenchmarkRouterPublished(b *testing.B) {
	for _, dec := range []bool{false, true} {
		b.Run(map[bool]string{false: "goroutine", true: "TracePublished"}[dec], func(b *testing.B) {
			tp := sdktrace.NewTracerProvider()
			defer tp.Shutdown(context.Background())
			mw, _ := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMeterProvider(noop.NewMeterProvider()))
			ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			defer ps.Close()
			router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if dec {
				router.AddPublisherDecorators(middleware.TracePublished)
			}
			router.AddMiddleware(mw)
			var n atomic.Int64
			for h := range 8 {
				topic := fmt.Sprintf("in-%d", h)
				router.AddHandler(topic, topic, ps, "out", countPub{&n}, func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage("out", nil)}, nil
				})
			}
			go func() { _ = router.Run(context.Background()) }()
			<-router.Running()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				_ = ps.Publish(fmt.Sprintf("in-%d", i%8), message.NewMessage("m", nil))
			}
			for n.Load() < int64(b.N) {
				time.Sleep(100 * time.Microsecond)
			}
			b.StopTimer()
			_ = router.Close()
		})
	}
}

// The tracing middleware by itself, called directly on a message carrying a
// sampled traceparent: sampled (two spans, the metrics), and with a sampler
// that drops every trace (the metrics only). The spans go through the batch
// span processor into an exporter that discards them, as in bench's stack
// section.
func BenchmarkTracingMiddleware(b *testing.B) {
	for _, c := range []struct {
		name    string
		sampler sdktrace.Sampler
	}{{"sampled", sdktrace.ParentBased(sdktrace.AlwaysSample())}, {"dropped", sdktrace.NeverSample()}} {
		b.Run(c.name, func(b *testing.B) {
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardSpans{}), sdktrace.WithSampler(c.sampler))
			defer tp.Shutdown(context.Background())
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			defer mp.Shutdown(context.Background())
			mw, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMeterProvider(mp))
			if err != nil {
				b.Fatal(err)
			}
			h := mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			msg := message.NewMessage("m-1", nil)
			msg.Metadata.Set("traceparent", "00-0000000000000001000000000000005e-0000000000000001-01")
			b.ReportAllocs()
			for b.Loop() {
				_, _ = h(msg)
			}
		})
	}
}

type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }
