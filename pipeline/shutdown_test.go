package pipeline_test

import (
	"context"
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
	"github.com/settle-go/settle/pipeline"
)

// keepSpans is an exporter that keeps its spans when shut down.
type keepSpans struct{ *tracetest.InMemoryExporter }

func (keepSpans) Shutdown(context.Context) error { return nil }

// A pipeline closed with deliveries in flight, its tracer provider shut down
// right after, loses no settlement (the process span records it), on a consumer handler and on a
// producing handler without a store (whose output the router used to
// publish after the chain had returned, ending the settle span on a
// goroutine of its own). Watermill's Close can start a delivery after it
// first found none running; what is checked is every delivery whose chain
// returned before the shutdown.
func TestNoSettleSpanLostAtShutdown(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(keepSpans{exp}, sdktrace.WithBatchTimeout(time.Hour)))
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer func() { _ = ps.Close() }()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	must(t, err)
	var (
		mu       sync.Mutex
		returned []string
	)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			defer func() { mu.Lock(); returned = append(returned, msg.UUID); mu.Unlock() }()
			return h(msg)
		}
	})
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps,
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(noop.NewMeterProvider())}})
	must(t, err)
	var runs atomic.Int64
	const handlers, perHandler = 6, 40
	for h := range handlers {
		topic := fmt.Sprintf("in-%d", h)
		if h%2 == 0 {
			_, err = p.Handle(topic, topic, ps, func(*message.Message) error { runs.Add(1); time.Sleep(time.Millisecond); return nil })
		} else {
			_, err = p.HandleProducing(topic, topic, ps, "out-"+topic, func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				time.Sleep(time.Millisecond)
				return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
			})
		}
		must(t, err)
		for i := range perHandler {
			must(t, ps.Publish(topic, message.NewMessage(fmt.Sprintf("%s-%03d", topic, i), nil)))
		}
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	deadline := time.Now().Add(10 * time.Second)
	for runs.Load() < handlers*perHandler/4 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	must(t, router.Close())
	mu.Lock()
	got := append([]string(nil), returned...)
	mu.Unlock()
	must(t, tp.Shutdown(context.Background()))
	must(t, <-done)

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
	lost := 0
	for _, id := range got {
		if settled[id] == 0 {
			lost++
			continue
		}
		settled[id]--
	}
	if lost > 0 || len(got) < 30 {
		t.Fatalf("%d of the %d deliveries that returned before the shutdown have no process span recording their settlement", lost, len(got))
	}
}
