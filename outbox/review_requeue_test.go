package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// healingBroker refuses one topic until healed, and counts every message
// taken.
type healingBroker struct {
	mu     sync.Mutex
	got    map[string]int
	healed atomic.Bool
}

func (b *healingBroker) Publish(topic string, msgs ...*message.Message) error {
	if topic == "review.sick" && !b.healed.Load() {
		return errors.New("review: refused")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		b.got[m.UUID]++
	}
	return nil
}

func (b *healingBroker) Close() error { return nil }

// review: two relays on their own pools, good traffic, rows to a refused
// topic set aside, and Requeue called again and again while the relays
// run (as an operator re-running settle outbox retry -yes); then the topic
// heals and a last Requeue: every row, good or once refused, is taken by
// the broker exactly once, and nothing is left pending or set aside.
func TestReviewRequeueRacesTwoRelays(t *testing.T) {
	t.Parallel()
	for _, d := range drivers() {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, d)
			// The second relay on a pool of its own (SQLite: one file, one pool).
			other := e.elsewhere(t, outbox.Config{Topic: e.ob.Topic()})
			b := &healingBroker{got: map[string]int{}}
			cfg := outbox.RelayConfig{PollInterval: 10 * time.Millisecond, BatchSize: 5, RetryInterval: 5 * time.Millisecond,
				MaxRetryInterval: 20 * time.Millisecond, MaxAttempts: 2, HeartbeatInterval: time.Second}
			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			for _, ob := range []*obx{e.ob, other} {
				r, err := ob.NewRelay(b, cfg)
				if err != nil {
					t.Fatal(err)
				}
				wg.Add(1)
				go func() { defer wg.Done(); _ = r.Run(ctx) }()
				defer func() { _ = r.Close() }()
			}
			defer func() { cancel(); wg.Wait() }()

			want := map[string]bool{}
			stop := time.Now().Add(3 * time.Second)
			for i := 0; time.Now().Before(stop); i++ {
				topic := "review.good"
				if i%4 == 0 {
					topic = "review.sick"
				}
				m := message.NewMessage(fmt.Sprintf("m-%d-%s", i, watermill.NewShortUUID()), []byte("{}"))
				want[m.UUID] = true
				e.publishTx(t, topic, m)
				if i%3 == 0 {
					if _, err := e.ob.Requeue(t.Context(), outbox.Selection{}); err != nil {
						t.Fatal(err)
					}
				}
				time.Sleep(5 * time.Millisecond)
			}
			b.healed.Store(true)
			deadline := time.Now().Add(60 * time.Second)
			for {
				if _, err := e.ob.Requeue(t.Context(), outbox.Selection{}); err != nil {
					t.Fatal(err)
				}
				st, err := e.ob.Status(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				b.mu.Lock()
				n := len(b.got)
				b.mu.Unlock()
				if st.Pending == 0 && st.SetAside == 0 && n == len(want) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after the heal: %d of %d taken, status %+v", n, len(want), st)
				}
				time.Sleep(50 * time.Millisecond)
			}
			b.mu.Lock()
			defer b.mu.Unlock()
			for id := range want {
				if b.got[id] != 1 {
					t.Errorf("%s taken %d times, want 1", id, b.got[id])
				}
			}
		})
	}
}
