package middleware_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// events is what a parking middleware did, in order.
type events struct {
	mu  sync.Mutex
	log []string
}

func (e *events) add(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.log = append(e.log, s)
}

func (e *events) get() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.log...)
}

// recordingStore is a ParkStore in memory that notes each Park in ev and
// fails while fail is set. It stands for the seam only: package parked's
// store is tested on every database in pipeline's tests.
type recordingStore struct {
	ev       *events
	mu       sync.Mutex
	failures int // the first Parks that fail
	parked   []settle.Parked
}

func (s *recordingStore) Park(_ context.Context, p settle.Parked) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failures > 0 {
		s.failures--
		s.ev.add("park failed")
		return errors.New("table settle_parked does not exist")
	}
	s.ev.add("park " + string(p.Outcome))
	s.parked = append(s.parked, p)
	return nil
}

// recordingPublisher notes each publish in ev.
type recordingPublisher struct {
	ev   *events
	fail bool
}

func (p *recordingPublisher) Publish(topic string, _ ...*message.Message) error {
	if p.fail {
		p.ev.add("publish failed")
		return errors.New("broker unreachable")
	}
	p.ev.add("publish " + topic)
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func TestParkingNeedsADestination(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	store := &recordingStore{ev: &events{}}
	for _, c := range []struct {
		cfg   middleware.ParkConfig
		field string // "" when accepted
	}{
		{middleware.ParkConfig{}, "Store"},
		{middleware.ParkConfig{Store: store}, ""},
		{middleware.ParkConfig{Store: store, Publisher: pub, Topic: "dead"}, ""},
		{middleware.ParkConfig{Store: store, Publisher: pub}, "Topic"},
		{middleware.ParkConfig{Store: store, Topic: "dead"}, "Publisher"},
		{middleware.ParkConfig{Store: store, NackDelay: -time.Second}, "NackDelay"},
		{middleware.ParkConfig{Store: store, PendingMessages: -1}, "PendingMessages"},
	} {
		for name, build := range map[string]func(middleware.ParkConfig) (message.HandlerMiddleware, error){
			"NewDeadLetter": middleware.NewDeadLetter, "NewPoison": middleware.NewPoison,
		} {
			_, err := build(c.cfg)
			switch {
			case c.field == "" && err != nil:
				t.Errorf("%s(%+v) refused: %v", name, c.cfg, err)
			case c.field != "" && (err == nil || !strings.Contains(err.Error(), "ParkConfig."+c.field)):
				t.Errorf("%s(%+v) = %v; want an error naming ParkConfig.%s", name, c.cfg, err, c.field)
			}
		}
	}
}

// With a store and a topic, the row is written first, then the copy is
// published, then the original acked; a store that fails defers the
// delivery (no copy, not acked, no attempt) and its redelivery is parked
// without running the handler. Park gets the original whole (not the
// bounded copy), the cause, handler, topic, key, attempts, times and trace.
func TestParkingWritesTheRowBeforeTheCopyAndTheAck(t *testing.T) {
	t.Parallel()
	ev := &events{}
	store := &recordingStore{ev: ev, failures: 1}
	pub := &recordingPublisher{ev: ev}
	cfg := middleware.ParkConfig{Store: store, Publisher: pub, Topic: "poisoned", NackDelay: settle.NoDelay}
	ps, err := middleware.NewPoison(cfg)
	must(t, err)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: dedupe.NewMemoryStore(), Key: dedupe.MetadataKey("order_id", "order:")})
	must(t, err)
	spans := tracetest.NewSpanRecorder()
	tr, err := middleware.NewTracing(settle.WithTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))), settle.WithPropagators(propagation.TraceContext{}))
	must(t, err)
	cause := poison.Permanent(errors.New("card expired"))
	in := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 4}, nil)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, nil)
	must(t, err)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ev.add("delivery")
			out, err := h(msg)
			if err == nil {
				ev.add("ack")
			} else {
				ev.add("nack")
			}
			return out, err
		}
	})
	router.AddConsumerHandler("charge", "orders", in, func(*message.Message) error {
		ev.add("handler")
		return cause
	}).AddMiddleware(tr, ps, dd)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
		must(t, in.Close())
	})
	big := strings.Repeat("x", 512<<10)
	msg := message.NewMessage("m-1", []byte("\xff payload"))
	msg.Metadata.Set("order_id", "17")
	msg.Metadata.Set("big", big)
	msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	must(t, in.Publish("orders", msg))
	eventually(t, 5*time.Second, "acked", func() bool { return slices.Contains(ev.get(), "ack") })
	want := []string{"delivery", "handler", "park failed", "nack", "delivery", "park poisoned", "publish poisoned", "ack"}
	if got := ev.get(); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("events %v; want %v", got, want)
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	p := store.parked[0]
	if p.Message.Metadata.Get("big") != big || string(p.Message.Payload) != "\xff payload" || p.Message.UUID != "m-1" {
		t.Errorf("Park got the message %s with a %d-byte big value; want the original whole", p.Message.UUID, len(p.Message.Metadata.Get("big")))
	}
	if !errors.Is(p.Cause, cause) || p.Handler != "charge" || p.Topic != "orders" || p.Key != "order:17" || p.Attempts != 1 ||
		p.TraceID != "4bf92f3577b34da6a3ce929d0e0e4736" || p.FirstFailure.IsZero() || p.LastFailure.Before(p.FirstFailure) {
		t.Errorf("Park got %+v", p)
	}
	// Each Park is an internal span "park orders" under its delivery's
	// process span: the failed one with error status.
	process := map[trace.SpanID]bool{}
	var parks []sdktrace.ReadOnlySpan
	for _, sp := range spans.Ended() {
		switch sp.Name() {
		case "process orders":
			process[sp.SpanContext().SpanID()] = true
		case "park orders":
			parks = append(parks, sp)
		}
	}
	if len(parks) != 2 {
		t.Fatalf("%d park spans; want 2", len(parks))
	}
	for i, want := range []codes.Code{codes.Error, codes.Unset} {
		sp := parks[i]
		if !process[sp.Parent().SpanID()] || sp.SpanKind() != trace.SpanKindInternal || sp.Status().Code != want ||
			!slices.Contains(sp.Attributes(), attribute.String("settle.outcome", "poisoned")) {
			t.Errorf("park span %d: parent a process span %v, kind %v, status %v, attributes %v", i, process[sp.Parent().SpanID()], sp.SpanKind(), sp.Status(), sp.Attributes())
		}
	}
}

// A copy the topic refuses after the row was written defers the delivery;
// its redelivery calls Park again (the store keeps one row) before the copy.
func TestParkingParksAgainWhenTheCopyFailed(t *testing.T) {
	t.Parallel()
	ev := &events{}
	store := &recordingStore{ev: ev}
	pub := &recordingPublisher{ev: ev, fail: true}
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Store: store, Publisher: pub, Topic: "dead", NackDelay: settle.NoDelay})
	must(t, err)
	h := dl(func(*message.Message) ([]*message.Message, error) {
		ev.add("handler")
		return nil, &middleware.ExhaustedError{Err: errFlaky, Attempts: 5, FirstFailure: time.Now().Add(-time.Minute), LastFailure: time.Now()}
	})
	msg := message.NewMessage("m-2", nil)
	if _, err := h(msg); err == nil {
		t.Fatal("acked with its copy unpublished")
	}
	pub.fail = false
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	want := "handler,park dead_lettered,publish failed,park dead_lettered,publish dead"
	if got := strings.Join(ev.get(), ","); got != want {
		t.Fatalf("events %s; want %s", got, want)
	}
	if p := store.parked[1]; p.Attempts != 5 || !errors.Is(p.Cause, errFlaky) || p.LastFailure.Sub(p.FirstFailure) < 59*time.Second {
		t.Fatalf("second Park got %+v", p)
	}
}

// stuckStore is a parked store behind a silent network partition: each
// Park waits until its context ends, and says whether it had a deadline.
type stuckStore struct {
	mu        sync.Mutex
	calls     int
	deadlines []time.Duration // the time each Park was given
}

func (s *stuckStore) Park(ctx context.Context, _ settle.Parked) error {
	d, ok := ctx.Deadline()
	s.mu.Lock()
	s.calls++
	if ok {
		s.deadlines = append(s.deadlines, time.Until(d))
	}
	s.mu.Unlock()
	<-ctx.Done()
	return ctx.Err()
}

// On a hand-built router, a Park that does not return has
// ParkConfig.StoreTimeout as its deadline (10s by default): the delivery is
// deferred within it, not held with its router slot for good, and never
// acked.
func TestParkingStoreCallHasADeadline(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		timeout time.Duration
		want    time.Duration
	}{{"default", 0, 10 * time.Second}, {"set", 30 * time.Millisecond, 30 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := &stuckStore{}
			ps, err := middleware.NewPoison(middleware.ParkConfig{Store: store, StoreTimeout: tc.timeout, NackDelay: settle.NoDelay})
			must(t, err)
			in := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 4}, nil)
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, nil)
			must(t, err)
			var acked sync.Map
			router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					out, err := h(msg)
					if err == nil {
						acked.Store(msg.UUID, true)
					}
					return out, err
				}
			})
			router.AddConsumerHandler("charge", "orders", in, func(m *message.Message) error {
				return poison.Permanent(errors.New("card expired"))
			}).AddMiddleware(ps)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			t.Cleanup(func() {
				must(t, router.Close())
				must(t, <-done)
				must(t, in.Close())
			})
			msg := message.NewMessage("m-1", []byte("x"))
			must(t, in.Publish("orders", msg))
			eventually(t, 5*time.Second, "a Park with a deadline", func() bool {
				store.mu.Lock()
				defer store.mu.Unlock()
				return len(store.deadlines) >= 1
			})
			store.mu.Lock()
			first := store.deadlines[0]
			store.mu.Unlock()
			if first > tc.want || first < tc.want-time.Second/2 && tc.want > time.Second {
				t.Errorf("Park had %v left; want about %v", first, tc.want)
			}
			if tc.timeout > 0 {
				eventually(t, 5*time.Second, "three Parks, each ended by its deadline", func() bool {
					store.mu.Lock()
					defer store.mu.Unlock()
					return store.calls >= 3
				})
			}
			if _, ok := acked.Load("m-1"); ok {
				t.Error("the message was acked although it was never parked")
			}
		})
	}
}
