package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/metric/noop"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/otlptest"
	"github.com/settle-go/settle/middleware"
)

// A service that closes its router and shuts its tracer provider down right
// after, as a clean shutdown does, loses no settlement: each process span,
// which records it (settle.settled), ended
// before its delivery left the middleware chain, so before router.Close
// returned. The router has deliveries in flight when it is closed, on
// consumer handlers (some failing once, so nacked) and on producing handlers
// whose output a middleware inside the tracing one publishes (as
// dedupe.Config.Publisher and pipeline do).
//
// Watermill's Close waits for the deliveries running when it first finds
// none running; one the router starts after that (it still reads its
// subscriptions while they close) can outlive Close, with all its spans. So
// what is checked is every delivery whose chain had returned before the
// provider was shut down: each has its process span, settlement recorded.
func TestNoSettleSpanLostAtShutdown(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(keep{exp}, sdktrace.WithBatchTimeout(time.Hour)))
	returned := closeThenShutdown(t, tp)
	settled := map[string]int{}
	for _, s := range exp.GetSpans() {
		// The process span ends at the settlement and records it.
		var id string
		recorded := false
		for _, a := range s.Attributes {
			switch a.Key {
			case "messaging.message.id":
				id = a.Value.AsString()
			case "settle.settled":
				recorded = strings.HasPrefix(s.Name, "process ")
			}
		}
		if recorded {
			settled[id]++
		}
	}
	checkSettled(t, returned, settled, "exporter")
}

// The same through otlptracehttp to a real OTLP/HTTP receiver.
func TestNoSettleSpanLostAtShutdownOTLP(t *testing.T) {
	t.Parallel()
	recv := otlptest.New(t)
	tp := recv.TracerProvider(t)
	returned := closeThenShutdown(t, tp)
	settled := map[string]int{}
	for _, s := range recv.Spans() {
		if st, _ := otlptest.Attr(s, "settle.settled"); st != "" {
			id, _ := otlptest.Attr(s, "messaging.message.id")
			settled[id]++
		}
	}
	checkSettled(t, returned, settled, "receiver")
}

func checkSettled(t *testing.T, returned []string, settled map[string]int, where string) {
	t.Helper()
	lost := 0
	for _, id := range returned {
		if settled[id] == 0 {
			lost++
			continue
		}
		settled[id]--
	}
	if lost > 0 {
		t.Fatalf("%d of the %d deliveries that returned before the shutdown have no process span recording their settlement at the %s", lost, len(returned), where)
	}
	if len(returned) < 40 {
		t.Fatalf("only %d deliveries returned before the shutdown; the test wants more in flight", len(returned))
	}
}

// publishInside publishes what the handler returns and returns nothing to
// the router.
func publishInside(pub message.Publisher, topic string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && len(out) > 0 {
				err = pub.Publish(topic, out...)
			}
			return nil, err
		}
	}
}

// keep is an exporter that keeps its spans when shut down (the in-memory
// exporter forgets them).
type keep struct{ *tracetest.InMemoryExporter }

func (keep) Shutdown(context.Context) error { return nil }

// closeThenShutdown runs a router with the tracing middleware on tp, closes
// it while deliveries are in flight, then shuts tp down at once. It returns
// the message IDs of the deliveries whose chain had returned by then (an
// ID once per delivery).
func closeThenShutdown(t *testing.T, tp *sdktrace.TracerProvider) []string {
	t.Helper()
	mw, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMeterProvider(noop.NewMeterProvider()))
	must(t, err)
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer func() { _ = pubsub.Close() }()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	must(t, err)
	var (
		mu       sync.Mutex
		returned []string
	)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			defer func() {
				mu.Lock()
				returned = append(returned, msg.UUID)
				mu.Unlock()
			}()
			return h(msg)
		}
	}, mw)

	const handlers, perHandler = 8, 40
	var (
		runs   atomic.Int64
		failed sync.Map // UUID -> struct{}: failed once already
	)
	errOnce := errors.New("fails once")
	work := func(msg *message.Message) error {
		runs.Add(1)
		time.Sleep(time.Millisecond)
		if msg.Metadata.Get("fail") != "" {
			if _, again := failed.LoadOrStore(msg.UUID, struct{}{}); !again {
				return errOnce
			}
		}
		return nil
	}
	for h := range handlers {
		topic := fmt.Sprintf("in-%d", h)
		if h%2 == 0 {
			router.AddConsumerHandler(topic, topic, pubsub, work)
		} else {
			out := "out-" + topic
			router.AddHandler(topic, topic, pubsub, out, pubsub, func(msg *message.Message) ([]*message.Message, error) {
				if err := work(msg); err != nil {
					return nil, err
				}
				return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
			}).AddMiddleware(publishInside(pubsub, out), middleware.TraceProduced)
		}
		for i := range perHandler {
			m := message.NewMessage(fmt.Sprintf("%s-%03d", topic, i), nil)
			if i%4 == 1 {
				m.Metadata.Set("fail", "1")
			}
			must(t, pubsub.Publish(topic, m))
		}
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	eventually(t, 10*time.Second, "handler runs", func() bool { return runs.Load() >= handlers*perHandler/4 })
	must(t, router.Close())
	mu.Lock()
	got := append([]string(nil), returned...)
	mu.Unlock()
	must(t, tp.Shutdown(context.Background())) // what a service does right after
	must(t, <-done)
	return got
}
