package pipeline_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
)

// A HandleProducing handler's output, published by the dedupe middleware
// before the key is confirmed, continues the handler's trace: its consumer's
// process span is in the same trace, under the create span of the message.
func TestProducedMessagesContinueTheTrace(t *testing.T) {
	t.Parallel()
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps, Store: dedupe.NewMemoryStore(), Retry: fastRetry(),
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})},
	})
	must(t, err)
	_, err = p.HandleProducing("ship", "orders", ps, "shipments", func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("ship-"+msg.UUID, nil)}, nil
	})
	must(t, err)
	_, err = p.Handle("notify", "shipments", ps, func(*message.Message) error { return nil })
	must(t, err)
	h := &harness{pubsub: ps, router: router, p: p, spans: rec}
	h.run(t)
	must(t, ps.Publish("orders", message.NewMessage("o-1", nil)))
	byName := func(name string) []sdktrace.ReadOnlySpan {
		var out []sdktrace.ReadOnlySpan
		for _, s := range rec.Ended() {
			if s.Name() == name {
				out = append(out, s)
			}
		}
		return out
	}
	acked := func(name string) bool {
		got := byName(name)
		return len(got) == 1 && settledAs(got[0]) == "ack"
	}
	waitFor(t, "both deliveries acked", func() bool { return acked("process orders") && acked("process shipments") })
	procs, creates, notify := byName("process orders"), byName("create shipments"), byName("process shipments")
	if len(procs) != 1 || len(creates) != 1 || len(notify) != 1 {
		t.Fatalf("%d process orders, %d create shipments, %d process shipments spans; want one each", len(procs), len(creates), len(notify))
	}
	if creates[0].Parent().SpanID() != procs[0].SpanContext().SpanID() {
		t.Errorf("the create span is not under the producing delivery's process span")
	}
	if notify[0].SpanContext().TraceID() != procs[0].SpanContext().TraceID() || notify[0].Parent().SpanID() != creates[0].SpanContext().SpanID() {
		t.Errorf("the produced message's process span is in trace %s under %s; want trace %s under the create span",
			notify[0].SpanContext().TraceID(), notify[0].Parent().SpanID(), procs[0].SpanContext().TraceID())
	}
}

// The messages a HandleTx handler publishes through the outbox continue the
// delivery's trace, although the handler did not give them its context: the
// outbox's create span is a child of the process span.
func TestTxOutboxMessagesContinueTheTrace(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	e := newTxEnv(t, stdOf(db))
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ob, err := outbox.New(std(db), outbox.Config{Topic: e.ob.Topic(), Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})}})
	must(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps, Store: e.store, Retry: fastRetry(),
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})},
	})
	must(t, err)
	_, err = pipeline.HandleTx(p, "charge", "payments", ps, pipeline.TxConfig[*sql.Tx]{DB: std(db), Outbox: ob},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
			return out.Publish("receipts", message.NewMessage("receipt-"+msg.UUID, nil)) // no SetContext
		})
	must(t, err)
	h := &harness{pubsub: ps, router: router, p: p, spans: rec}
	h.run(t)
	must(t, ps.Publish("payments", message.NewMessage("p-1", nil)))
	var proc, create sdktrace.ReadOnlySpan
	waitFor(t, "the process and create spans", func() bool {
		for _, s := range rec.Ended() {
			switch s.Name() {
			case "process payments":
				proc = s
			case "create receipts":
				create = s
			}
		}
		return proc != nil && create != nil
	})
	if create.SpanContext().TraceID() != proc.SpanContext().TraceID() || create.Parent().SpanID() != proc.SpanContext().SpanID() {
		t.Fatalf("the outbox's create span is in trace %s under %s; want trace %s under the process span %s",
			create.SpanContext().TraceID(), create.Parent().SpanID(), proc.SpanContext().TraceID(), proc.SpanContext().SpanID())
	}
	// The create span names the handler that wrote it, as every span of the
	// delivery does.
	var handler string
	for _, kv := range create.Attributes() {
		if kv.Key == "settle.handler" {
			handler = kv.Value.AsString()
		}
	}
	if handler == "" {
		t.Fatalf("the create span has no settle.handler: %v", create.Attributes())
	}
}

// settledAs is what the router did with a delivery, as its process span
// records it (settle.settled): "ack", "nack", or "" for any other span.
func settledAs(s sdktrace.ReadOnlySpan) string {
	if !strings.HasPrefix(s.Name(), "process ") {
		return ""
	}
	for _, a := range s.Attributes() {
		if a.Key == "settle.settled" {
			return a.Value.AsString()
		}
	}
	return ""
}
