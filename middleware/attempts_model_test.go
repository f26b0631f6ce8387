package middleware_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// outageStore is a dedupe store that cannot answer while down.
type outageStore struct {
	dedupe.Store
	down   atomic.Bool
	claims atomic.Int64
}

func (s *outageStore) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	s.claims.Add(1)
	if s.down.Load() {
		return dedupe.Claim{}, errors.New(`relation "claims" does not exist`)
	}
	return s.Store.Claim(ctx, key, ttl)
}

// A store that cannot answer defers deliveries: the handler does not run,
// nothing is dead-lettered however long the outage, and once the store is
// back every message is done once.
func TestStoreOutageDefers(t *testing.T) {
	t.Parallel()
	store := &outageStore{Store: dedupe.NewMemoryStore()}
	store.down.Store(true)
	s := newStack(t, stackOpts{retry: fastRetry(2, 1), store: store}, func(*message.Message) error { return nil })
	const n = 5
	for range n {
		s.publish(message.NewMessage(watermill.NewUUID(), nil))
	}
	// Many times MaxAttempts deliveries each.
	eventually(t, 5*time.Second, "deferrals", func() bool { return store.claims.Load() >= 10*n })
	if c := s.calls.Load(); c != 0 {
		t.Fatalf("the handler ran %d times while the store could not answer", c)
	}
	store.down.Store(false)
	s.waitAcked(n)
	settled, dead, pois := s.snapshot()
	if s.effects.Load() != n || len(dead)+len(pois) != 0 {
		t.Fatalf("effects=%d dead=%d poison=%d; want %d effects, nothing parked", s.effects.Load(), len(dead), len(pois), n)
	}
	for _, err := range settled {
		if err != nil && !errors.Is(err, dedupe.ErrUnavailable) {
			t.Fatalf("a delivery settled with %v; want only deferrals wrapping dedupe.ErrUnavailable", err)
		}
	}
}

// The dedupe middleware alone, as the README shows it, waits BusyDelay before
// a busy key is nacked: no spin.
func TestBusyWaitsWithoutRetry(t *testing.T) {
	t.Parallel()
	store := &outageStore{Store: dedupe.NewMemoryStore()}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, BusyDelay: 20 * time.Millisecond})
	must(t, err)
	uuid := watermill.NewUUID()
	if _, err := store.Store.Claim(t.Context(), uuid, time.Minute); err != nil {
		t.Fatal(err)
	}
	h := dd(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	deadline := time.Now().Add(200 * time.Millisecond)
	for time.Now().Before(deadline) {
		if _, err := h(message.NewMessage(uuid, nil)); !errors.Is(err, dedupe.ErrBusy) {
			t.Fatalf("err = %v; want ErrBusy", err)
		}
	}
	if c := store.claims.Load(); c > 12 {
		t.Fatalf("%d claims of a busy key in 200ms with BusyDelay 20ms", c)
	}
}

// A poison message whose copy cannot be published at first is deferred, not
// failed: the handler that returned a permanent error is not run again, no
// attempt is counted, and the copy reaches the poison topic (never the
// dead-letter) with the handler's reason once the publisher recovers.
func TestFailedPoisonParkIsNotAnAttempt(t *testing.T) {
	t.Parallel()
	for _, c := range counting[:2] {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pub := &flakyPublisher{}
			pub.fail.Store(4) // more than MaxAttempts
			o := c.opts(stackOpts{retry: fastRetry(3, 1), parkPub: pub})
			s := newStack(t, o, func(*message.Message) error { return poison.Permanent(errors.New("currency XXX unknown")) })
			pub.Publisher = s.pubsub
			s.publish(message.NewMessage(watermill.NewUUID(), nil))
			s.waitAcked(1)
			// The copy reaches the poison topic's subscriber after the ack.
			eventually(t, 5*time.Second, "the poison copy", func() bool { _, d, p := s.snapshot(); return len(d)+len(p) > 0 })
			settled, dead, pois := s.snapshot()
			if s.calls.Load() != 1 {
				t.Fatalf("the handler ran %d times; a permanent failure runs once", s.calls.Load())
			}
			if len(dead) != 0 || len(pois) != 1 {
				t.Fatalf("dead=%d poison=%d; want the copy on the poison topic only", len(dead), len(pois))
			}
			if got := pois[0].Metadata.Get(settle.MetaReason); got != "permanent: currency XXX unknown" {
				t.Fatalf("poison reason %q; want the handler's error", got)
			}
			if len(settled) != 5 || pub.attempts.Load() != 5 {
				t.Fatalf("%d deliveries, %d publishes; want 4 deferrals and the parked one", len(settled), pub.attempts.Load())
			}
		})
	}
}

// Attempts are counted per logical handler: two handlers consuming the same
// message (GoChannel fan-out) each get MaxAttempts runs.
func TestAttemptsPerHandler(t *testing.T) {
	t.Parallel()
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	t.Cleanup(func() { _ = ps.Close() })
	rt, err := middleware.NewRetry(fastRetry(3, 1)) // one middleware shared, as a pipeline does
	must(t, err)
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: ps, Topic: deadTopic})
	must(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	must(t, err)
	var mu sync.Mutex
	runs := map[string]int{}
	for _, name := range []string{"charge", "email"} {
		router.AddConsumerHandler(name, topic, ps, func(msg *message.Message) error {
			mu.Lock()
			runs[name]++
			mu.Unlock()
			return errFlaky
		}).AddMiddleware(dl, rt)
	}
	dead, err := ps.Subscribe(t.Context(), deadTopic)
	must(t, err)
	stop := make(chan error, 1)
	go func() { stop <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { must(t, router.Close()); must(t, <-stop) })
	must(t, ps.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)))
	handlers := map[string]bool{}
	for range 2 {
		select {
		case m := <-dead:
			handlers[m.Metadata.Get(settle.MetaHandler)] = true
			m.Ack()
		case <-time.After(5 * time.Second):
			t.Fatal("not dead-lettered")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if runs["charge"] != 3 || runs["email"] != 3 || !handlers["charge"] || !handlers["email"] {
		t.Fatalf("runs %v, dead-lettered by %v; want 3 runs and one dead-letter per handler", runs, handlers)
	}
}

// A dead-letter copy carries the time of the first failure, not the time of
// the refusal; when no process that saw the first failure is left (a crash
// loop, counted by the store), the copy carries none rather than a made-up one.
func TestFirstFailureIsTheFirst(t *testing.T) {
	t.Parallel()
	t.Run("failures seen", func(t *testing.T) {
		t.Parallel()
		cfg := fastRetry(3, 0)
		cfg.RedeliveryDelay = 30 * time.Millisecond
		s := newStack(t, stackOpts{retry: cfg}, func(*message.Message) error { return errFlaky })
		s.publish(message.NewMessage(watermill.NewUUID(), nil))
		s.waitDeadLettered()
		_, dead, _ := s.snapshot()
		first, err1 := time.Parse(time.RFC3339Nano, dead[0].Metadata.Get(settle.MetaFirstFailure))
		last, err2 := time.Parse(time.RFC3339Nano, dead[0].Metadata.Get(settle.MetaLastFailure))
		if err1 != nil || err2 != nil || last.Sub(first) < 50*time.Millisecond {
			t.Fatalf("first failure %q, last %q; want the first two redeliveries before the last",
				dead[0].Metadata.Get(settle.MetaFirstFailure), dead[0].Metadata.Get(settle.MetaLastFailure))
		}
	})
	t.Run("crash loop", func(t *testing.T) {
		t.Parallel()
		store := dedupe.NewMemoryStore()
		uuid := watermill.NewUUID()
		for range 3 { // three attempts that died with their consumer
			c, err := store.Claim(t.Context(), dedupe.ScopedKey(handlerName, uuid), time.Minute)
			must(t, err)
			must(t, store.Release(t.Context(), c))
		}
		time.Sleep(5 * time.Millisecond)
		started := time.Now()
		s := newStack(t, stackOpts{retry: fastRetry(3, 0), store: store}, func(*message.Message) error { return nil })
		s.publish(message.NewMessage(uuid, nil))
		s.waitDeadLettered()
		_, dead, _ := s.snapshot()
		md := dead[0].Metadata
		if s.calls.Load() != 0 || !strings.Contains(md.Get(settle.MetaReason), dedupe.ErrAttemptsUsedUp.Error()) || md.Get(settle.MetaAttempt) != "3" {
			t.Fatalf("calls=%d reason=%q attempt=%q; want the handler not run, refused after 3 attempts",
				s.calls.Load(), md.Get(settle.MetaReason), md.Get(settle.MetaAttempt))
		}
		// No process saw the first failure; the store dates the first
		// attempt, which began before this test's stack even started.
		first, err1 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaFirstFailure))
		last, err2 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaLastFailure))
		if err1 != nil || err2 != nil || !first.Before(last) || !first.Before(started) {
			t.Fatalf("first failure %q, last %q, stack started %v; want the first attempt's start, before both",
				md.Get(settle.MetaFirstFailure), md.Get(settle.MetaLastFailure), started)
		}
	})
}

// Spans and metrics count a delivery whose handler failed as retry, and one
// deferred because its parked copy could not be published as deferred, with
// no in-process retry counted for it.
func TestDeferredAndRetryAreCountedApart(t *testing.T) {
	t.Parallel()
	tr := newTraced(t)
	pub := &flakyPublisher{}
	pub.fail.Store(2)
	s := newStack(t, stackOpts{retry: fastRetry(2, 0), parkPub: pub, outer: tr.mw}, func(*message.Message) error { return errFlaky })
	pub.Publisher = s.pubsub
	s.publish(message.NewMessage(watermill.NewUUID(), nil))
	s.waitDeadLettered()
	eventually(t, 5*time.Second, "the last settlement", func() bool {
		for _, p := range byName(tr.rec.Ended(), "process "+topic) {
			if attr(p, attribute.Key("settle.outcome")).AsString() == "dead_lettered" {
				return true
			}
		}
		return false
	})
	outcomes := map[string]int{}
	for _, p := range byName(tr.rec.Ended(), "process "+topic) {
		outcomes[attr(p, attribute.Key("settle.outcome")).AsString()]++
	}
	// Run 1 fails (retry); run 2 fails, its dead-letter copy fails twice
	// (deferred, deferred), and the third delivery parks it.
	want := map[string]int{"retry": 1, "deferred": 2, "dead_lettered": 1}
	if len(outcomes) != len(want) || outcomes["retry"] != 1 || outcomes["deferred"] != 2 || outcomes["dead_lettered"] != 1 {
		t.Fatalf("process span outcomes %v, want %v", outcomes, want)
	}
	var rm metricdata.ResourceMetrics
	must(t, tr.reader.Collect(t.Context(), &rm))
	got := map[string]int64{}
	var retries int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			d, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			for _, dp := range d.DataPoints {
				switch m.Name {
				case "settle.settlements":
					o, _ := dp.Attributes.Value(attribute.Key("settle.outcome"))
					got[o.AsString()] += dp.Value
				case "settle.retries":
					retries += dp.Value
				}
			}
		}
	}
	if got["retry"] != 1 || got["deferred"] != 2 || got["dead_lettered"] != 1 || retries != 0 {
		t.Fatalf("settle.settlements %v, settle.retries %d; want retry 1, deferred 2, dead_lettered 1, no retries", got, retries)
	}
	if s.calls.Load() != 2 {
		t.Fatalf("the handler ran %d times; want MaxAttempts (2)", s.calls.Load())
	}
}

// A handler reads its attempt and the limit from the settlement.
func TestSettlementIsReadable(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(fastRetry(4, 3))
	must(t, err)
	var seen []int
	h := rt(func(msg *message.Message) ([]*message.Message, error) {
		st := settle.SettlementFromContext(msg.Context())
		seen = append(seen, st.Attempt()*10+st.MaxAttempts())
		if len(seen) < 3 {
			return nil, errFlaky
		}
		return nil, nil
	})
	if _, err := h(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 3 || seen[0] != 14 || seen[1] != 24 || seen[2] != 34 {
		t.Fatalf("attempt*10+limit seen %v; want [14 24 34]", seen)
	}
}
