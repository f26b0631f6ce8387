package dedupe_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	settlemw "github.com/settle-go/settle/middleware"
)

// A replayed copy addressed to another handler (settle.MetaReplayHandler)
// is acked without a claim and without running the handler, and settles as
// a duplicate; one addressed to this handler (named without the "#2" suffix
// of a pipeline's competing subscription) or to no one runs as before.
func TestReplayForAnotherHandlerIsAckedUnclaimed(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, keys := sc.new(t)
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
			tracing, err := settlemw.NewTracing(settle.WithTracerProvider(tp))
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			runs := map[string]int{}
			var acks recorder
			ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: waitTimeout}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddMiddleware(tracing, acks.middleware, newMiddleware(t, dedupe.Config{Store: store}))
			r.AddConsumerHandler("charge#2", "orders", ps, func(msg *message.Message) error {
				mu.Lock()
				runs[msg.UUID]++
				mu.Unlock()
				return nil
			})
			done := make(chan error, 1)
			go func() { done <- r.Run(context.Background()) }()
			t.Cleanup(func() {
				if err := r.Close(); err != nil {
					t.Errorf("close router: %v", err)
				}
				if err := <-done; err != nil {
					t.Errorf("router run: %v", err)
				}
				_ = ps.Close()
			})
			<-r.Running()

			publish := func(uuid, to string) {
				t.Helper()
				m := message.NewMessage(uuid, []byte("p"))
				if to != "" {
					m.Metadata.Set(settle.MetaReplayHandler, to)
				}
				if err := ps.Publish("orders", m); err != nil { // returns once acked
					t.Fatal(err)
				}
			}
			publish("for-ship", "ship")
			publish("for-charge#2", "charge#2") // a row's handler is a scope: no handler is "charge#2"
			if n := keys(); n != 0 {
				t.Errorf("%d claims after copies for other handlers; want none", n)
			}
			publish("for-charge", "charge")
			publish("for-anyone", "")
			publish("for-ship", "ship") // again: still not claimed
			mu.Lock()
			got := map[string]int{}
			for k, v := range runs {
				got[k] = v
			}
			mu.Unlock()
			if len(got) != 2 || got["for-charge"] != 1 || got["for-anyone"] != 1 {
				t.Errorf("runs %v; want for-charge and for-anyone once each", got)
			}
			if n := keys(); n != 2 {
				t.Errorf("%d claims; want 2 (the copies this handler ran)", n)
			}
			ds := acks.deliveries()
			if len(ds) != 5 {
				t.Fatalf("%d deliveries settled, want 5", len(ds))
			}
			for i, d := range ds {
				if d.err != nil {
					t.Errorf("delivery %d: %v; want acked", i, d.err)
				}
			}
			var outcomes map[string]int
			deadline := time.Now().Add(waitTimeout)
			for {
				outcomes = map[string]int{}
				for _, s := range rec.Ended() {
					if s.Name() != "process orders" {
						continue
					}
					for _, kv := range s.Attributes() {
						if kv.Key == attribute.Key("settle.outcome") {
							outcomes[kv.Value.AsString()]++
						}
					}
				}
				if outcomes["duplicate"]+outcomes["done"] >= 5 || time.Now().After(deadline) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			if outcomes["duplicate"] != 3 || outcomes["done"] != 2 {
				t.Errorf("outcomes %v; want 3 duplicates (copies for others) and 2 done", outcomes)
			}
		})
	}
}
