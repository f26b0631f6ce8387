package natsjs_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// runRouter runs a router with one handler until the test ends.
func runRouter(t *testing.T, name, topic string, sub message.Subscriber, h message.NoPublishHandlerFunc) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddConsumerHandler(name, topic, sub, h)
	runRouterOnly(t, r)
}

// runRouterOnly runs r until the test ends.
func runRouterOnly(t *testing.T, r *message.Router) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := r.Run(context.Background()); err != nil {
			t.Errorf("router: %v", err)
		}
	}()
	t.Cleanup(func() {
		_ = r.Close()
		<-done
	})
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
}

// A failed delivery goes back through JetStream's NakWithDelay: the retry
// middleware nacks it at once, so its subscription's only slot takes the
// next messages while it waits; it comes back no earlier than the delay;
// and its runs are still bounded by MaxAttempts.
func TestNakDelayFreesSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const delay = 1500 * time.Millisecond
	const maxAttempts = 2
	dlTopic := e.topic + ".dead_letter"

	failing := message.NewMessage("fails", []byte("{}"))
	msgs := []*message.Message{failing}
	for i := range 5 {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("ok-%d", i), []byte("{}")))
	}
	e.publish(t, msgs...)

	retry, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts: maxAttempts, NoInProcessRetries: true, RedeliveryDelay: delay,
	})
	if err != nil {
		t.Fatal(err)
	}
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: e.publisher(t), Topic: dlTopic})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		starts  []time.Time // runs of the failing message
		ends    []time.Time
		okDone  = map[string]time.Time{}
		allDone = make(chan struct{})
	)
	h := dl(retry(func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		defer mu.Unlock()
		if msg.UUID == failing.UUID {
			starts = append(starts, time.Now())
			ends = append(ends, time.Now())
			if len(starts) == maxAttempts {
				defer close(allDone)
			}
			return nil, errors.New("downstream refuses")
		}
		okDone[msg.UUID] = time.Now()
		return nil, nil
	}))
	sub := e.subscriber(t, natsjs.Config{Durable: "settle", NakDelay: delay, SubscribersCount: 1})
	runRouter(t, "h", e.topic, sub, func(msg *message.Message) error { _, err := h(msg); return err })

	select {
	case <-allDone:
	case <-time.After(20 * time.Second):
		t.Fatal("the failing message did not reach MaxAttempts runs")
	}
	e.waitSettled(t, "settle", 5*time.Second)

	mu.Lock()
	defer mu.Unlock()
	if len(starts) != maxAttempts {
		t.Fatalf("failing message ran %d times, want %d", len(starts), maxAttempts)
	}
	if len(okDone) != 5 {
		t.Fatalf("%d of 5 other messages handled", len(okDone))
	}
	for id, at := range okDone {
		// The slot was free while the failing message waited.
		if wait := at.Sub(ends[0]); wait > delay/2 {
			t.Errorf("%s handled %v after the failure, want < %v: the failed delivery held the slot", id, wait.Round(time.Millisecond), delay/2)
		}
		if at.After(starts[1]) {
			t.Errorf("%s handled after the failing message's redelivery", id)
		}
	}
	if gap := starts[1].Sub(ends[0]); gap < delay {
		t.Errorf("redelivered %v after the failed run, want >= %v", gap.Round(time.Millisecond), delay)
	}
	if n := e.streamCount(t, dlTopic); n != 1 {
		t.Errorf("%d copies on the dead-letter topic, want 1", n)
	}
}

// A delivery deferred because another worker holds its key goes back through
// JetStream's delay too: the subscription's only slot takes the next
// messages at once instead of holding the deferred one for BusyDelay.
func TestBusyDeferralFreesSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const busyDelay = 1500 * time.Millisecond
	store := dedupe.NewMemoryStore()
	// Another worker holds the key of "held" for the whole test.
	if c, err := store.Claim(t.Context(), dedupe.ScopedKey("h", "held"), time.Minute); err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("claim: %+v, %v", c, err)
	}
	msgs := []*message.Message{message.NewMessage("held", []byte("{}"))}
	for i := range 5 {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("ok-%d", i), []byte("{}")))
	}
	e.publish(t, msgs...)

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(r, pipeline.Config{Publisher: e.publisher(t), Store: store, DisableTracing: true, BusyDelay: busyDelay})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		done = map[string]time.Time{}
		all  = make(chan struct{})
	)
	sub := e.subscriber(t, natsjs.Config{Durable: "busy", NakDelay: busyDelay, SubscribersCount: 1})
	if _, err := p.Handle("h", e.topic, sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		done[msg.UUID] = time.Now()
		if len(done) == 5 {
			close(all)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	runRouterOnly(t, r)
	select {
	case <-all:
	case <-time.After(20 * time.Second):
		t.Fatal("the other messages were not handled")
	}
	mu.Lock()
	defer mu.Unlock()
	if _, ran := done["held"]; ran {
		t.Error("the held message ran although its key was held")
	}
	for id, at := range done {
		if wait := at.Sub(start); wait > busyDelay*2/3 {
			t.Errorf("%s handled %v after the start, want < %v: the deferred delivery held the slot", id, wait.Round(time.Millisecond), busyDelay*2/3)
		}
	}
}
