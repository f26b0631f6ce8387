package pipeline_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
)

// discardExporter drops spans after the batch processor collected them.
type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

// BenchmarkStack measures messages per second through a router on GoChannel
// with a no-op handler: the bare Watermill router (the floor), settle's full
// stack with the memory store and tracing off, and with tracing on (SDK
// providers, spans batched into a discarding exporter).
func BenchmarkStack(b *testing.B) {
	for _, mode := range []string{"bare", "settle", "settle+tracing"} {
		b.Run(mode, func(b *testing.B) {
			logger := watermill.NopLogger{}
			ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, logger)
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
			if err != nil {
				b.Fatal(err)
			}
			var done atomic.Int64
			finished := make(chan struct{})
			total := int64(b.N)
			handler := func(*message.Message) error {
				if done.Add(1) == total {
					close(finished)
				}
				return nil
			}
			switch mode {
			case "bare":
				router.AddConsumerHandler("h", "t", ps, handler)
			default:
				cfg := pipeline.Config{Publisher: ps, Store: dedupe.NewMemoryStore(), DisableTracing: mode == "settle"}
				if mode == "settle+tracing" {
					tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}))
					mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
					defer func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) }()
					cfg.Tracing = []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(mp)}
				}
				p, err := pipeline.New(router, cfg)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := p.Handle("h", "t", ps, handler); err != nil {
					b.Fatal(err)
				}
			}
			runDone := make(chan error, 1)
			go func() { runDone <- router.Run(context.Background()) }()
			<-router.Running()
			msgs := make([]*message.Message, b.N)
			for i := range msgs {
				msgs[i] = message.NewMessage("m-"+strconv.Itoa(i), nil)
			}
			b.ReportAllocs()
			b.ResetTimer()
			go func() {
				for _, m := range msgs {
					if err := ps.Publish("t", m); err != nil {
						panic(err)
					}
				}
			}()
			<-finished
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
			_ = router.Close()
			<-runDone
			_ = ps.Close()
		})
	}
}
