package pipeline_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
)

// A newcomer's program sets a tracer provider and no propagator (this test
// binary never calls otel.SetTextMapPropagator, so OTel's global one is its
// no-op): the request that wrote the outbox row, the relay's send span and
// the consumer's process span are still one trace, as docs/tracing.md says.
func TestDefaultPropagatorKeepsOneTrace(t *testing.T) {
	t.Parallel()
	if f := otel.GetTextMapPropagator().Fields(); len(f) != 0 {
		t.Fatalf("a test of this package set the global propagator (%v): this test needs it unset", f)
	}
	db := testenv.SQLite(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	ob, err := outbox.New(std(db), outbox.Config{Tracing: []settle.Option{settle.WithTracerProvider(tp)}}) // no WithPropagators
	must(t, err)
	must(t, ob.InitSchema(t.Context()))
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps, Store: dedupe.NewMemoryStore(), Retry: fastRetry(),
		Tracing: []settle.Option{settle.WithTracerProvider(tp)}, // no WithPropagators
	})
	must(t, err)
	_, err = p.Handle("email", "orders.placed", ps, func(*message.Message) error { return nil })
	must(t, err)
	h := &harness{pubsub: ps, router: router, p: p, spans: rec}
	h.run(t)

	relay, err := ob.NewRelay(ps, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	must(t, err)
	done := make(chan error, 1)
	go func() { done <- relay.Run(t.Context()) }()
	t.Cleanup(func() { must(t, relay.Close()); must(t, <-done) })

	ctx, req := tp.Tracer("test").Start(t.Context(), "place order")
	tx, err := db.BeginTx(ctx, nil)
	must(t, err)
	pub, err := ob.TxPublisher(tx)
	must(t, err)
	msg := message.NewMessage("order-1", []byte("{}"))
	msg.SetContext(ctx)
	must(t, pub.Publish("orders.placed", msg))
	must(t, tx.Commit())
	ob.Notify()
	req.End()

	var send, proc sdktrace.ReadOnlySpan
	waitFor(t, "the relay's send span and the consumer's process span", func() bool {
		for _, s := range rec.Ended() {
			switch s.Name() {
			case "send orders.placed":
				send = s
			case "process orders.placed":
				proc = s
			}
		}
		return send != nil && proc != nil
	})
	trace := req.SpanContext().TraceID()
	if send.SpanContext().TraceID() != trace {
		t.Errorf("the relay's send span started trace %s; want the request's trace %s", send.SpanContext().TraceID(), trace)
	}
	if proc.SpanContext().TraceID() != trace || proc.Parent().SpanID() != send.SpanContext().SpanID() {
		t.Errorf("the consumer's process span is in trace %s under %s; want trace %s under the send span %s",
			proc.SpanContext().TraceID(), proc.Parent().SpanID(), trace, send.SpanContext().SpanID())
	}
}
