package amqpsub_test

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Fewer messages than InFlight, the first one slow: the router acks the
// others, which reach the broker while the slow one runs (after at most
// maxAckHold), and after Close only the slow one (never answered) goes back
// to the queue, as TestAckedBeforeCloseStayAcked requires when nothing is
// slow.
func TestAckedBehindASlowOneAreAckedWithoutIt(t *testing.T) {
	t.Parallel()
	const n, inFlight = 5, 16
	f := newFixture(t, n)
	sub := f.subscriber(t, inFlight)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	var held *message.Message
	for i := range n {
		m := next(msgs, 10*time.Second)
		if m == nil {
			t.Fatalf("%d of %d messages within 10s", i, n)
		}
		if held == nil {
			held = m // the slow one: never answered
			continue
		}
		m.Ack()
	}
	time.Sleep(500 * time.Millisecond) // the acks have had every chance to leave
	// An ack waits behind an unanswered delivery for at most maxAckHold.
	if u, ok := unacked(t, f.queue); ok && u != 1 {
		t.Errorf("%d deliveries unacked on the broker 500ms after the router acked %d of %d, want 1", u, n-1, n)
	}
	must(t, sub.Close())
	if r := f.ready(t); r != 1 {
		t.Errorf("%d messages back in the queue after %d of %d were acked by the router, want 1 (the unanswered one)", r, n-1, n)
	}
}

// Close right after the router acked the messages behind a slow one: the
// last pass sends their acks, held or not.
func TestCloseAcksWhatIsHeldBehindASlowOne(t *testing.T) {
	t.Parallel()
	const n, inFlight = 5, 16
	for round := range 5 {
		f := newFixture(t, n)
		sub := f.subscriber(t, inFlight)
		msgs, err := sub.Subscribe(t.Context(), f.queue)
		must(t, err)
		var got []*message.Message
		for i := range n {
			m := next(msgs, 10*time.Second)
			if m == nil {
				t.Fatalf("%d of %d messages within 10s", i, n)
			}
			got = append(got, m)
		}
		for _, m := range got[1:] {
			m.Ack()
		}
		must(t, sub.Close()) // at once: within maxAckHold of the acks
		if r := f.ready(t); r != 1 {
			t.Fatalf("round %d: %d messages back in the queue after %d of %d were acked by the router, want 1 (the unanswered one)", round, r, n-1, n)
		}
	}
}

// The same with a router as users write it (Recoverer, Timeout): one
// handler is slow, the others finish, the router is closed while the slow
// one runs. The messages whose handlers finished before Close must not be
// delivered again; only the slow one may be.
func TestRouterCloseHandsBackOnlyUnfinished(t *testing.T) {
	t.Parallel()
	const n, inFlight = 5, 16
	f := newFixture(t, n)
	sub := f.subscriber(t, inFlight)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	router.AddMiddleware(middleware.Recoverer, middleware.Timeout(time.Minute))
	var finished atomic.Int64
	var mu sync.Mutex
	seen := map[string]int{}
	router.AddConsumerHandler("h", f.queue, sub, func(msg *message.Message) error {
		mu.Lock()
		seen[msg.UUID]++
		mu.Unlock()
		if msg.UUID == "m0" {
			time.Sleep(1500 * time.Millisecond) // slow, and it does not watch its context (an HTTP call with a timeout of its own)
			return nil
		}
		finished.Add(1)
		return nil
	})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- router.Run(ctx) }()
	<-router.Running()
	deadline := time.Now().Add(10 * time.Second)
	for finished.Load() < n-1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if finished.Load() != n-1 {
		t.Fatalf("%d of %d handlers finished", finished.Load(), n-1)
	}
	time.Sleep(500 * time.Millisecond)
	must(t, router.Close())
	must(t, <-errc)
	if r := f.ready(t); r > 1 {
		t.Errorf("%d messages back in the queue after the router finished %d of %d before Close (seen %v), want at most 1 (the slow one)", r, n-1, n, seen)
	}
}

// unacked is the broker's count of deliveries of queue not acked yet, read
// with rabbitmqctl (false when it is not available).
func unacked(t *testing.T, queue string) (int, bool) {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged").Output()
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(string(out)) {
		if name, n, ok := strings.Cut(strings.TrimSpace(line), "\t"); ok && name == queue {
			u, err := strconv.Atoi(n)
			return u, err == nil
		}
	}
	return 0, false
}
