package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// reviewBroker records every message published to it, and refuses one topic
// for good.
type reviewBroker struct {
	mu      sync.Mutex
	got     map[string]int // UUID -> publishes taken
	refused string
}

var errReviewRefused = errors.New("review: the broker refuses this destination")

func (b *reviewBroker) Publish(topic string, msgs ...*message.Message) error {
	if topic == b.refused {
		return errReviewRefused
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		b.got[m.UUID]++
	}
	return nil
}

func (b *reviewBroker) Close() error { return nil }

func (b *reviewBroker) counts() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string]int, len(b.got))
	for k, v := range b.got {
		out[k] = v
	}
	return out
}

// review: two relays on separate connection pools forward one outbox while
// transactions keep committing, one row in ten to a destination the broker
// refuses for good, and one foreign row whose metadata does not decode.
// Every good row goes out exactly once (no relay forwards a row the other
// did), the refused rows are set aside and stay (Status, Failed, and a
// Prune with no retention leave them), and nothing is pending at the end.
func TestReviewConcurrentRelaysWithRefusedRows(t *testing.T) {
	t.Parallel()
	for _, d := range drivers() {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, d)
			// The second relay on a pool of its own (SQLite: one file, one pool).
			other := e.elsewhere(t, outbox.Config{Topic: e.ob.Topic()})
			broker := &reviewBroker{got: map[string]int{}, refused: "review.refused"}
			cfg := outbox.RelayConfig{
				PollInterval: 20 * time.Millisecond, BatchSize: 7,
				RetryInterval: 5 * time.Millisecond, MaxRetryInterval: 20 * time.Millisecond, MaxAttempts: 3,
				HeartbeatInterval: time.Second,
			}
			var relays []*outbox.Relay
			for _, ob := range []*obx{e.ob, other} {
				r, err := ob.NewRelay(broker, cfg)
				if err != nil {
					t.Fatal(err)
				}
				relays = append(relays, r)
			}
			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			for _, r := range relays {
				wg.Add(1)
				go func() { defer wg.Done(); _ = r.Run(ctx) }()
			}
			defer func() {
				cancel()
				for _, r := range relays {
					_ = r.Close()
				}
				wg.Wait()
			}()

			good, refused := map[string]bool{}, map[string]bool{}
			e.rawInsert(t, watermill.NewUUID(), "review.good", []byte("foreign"), "not json")
			const txs, perTx = 30, 4
			for i := range txs {
				tx := e.begin(t, t.Context())
				pub := tx.Pub
				for j := range perTx {
					m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("%d.%d", i, j)))
					topic := "review.good"
					if (i*perTx+j)%10 == 3 {
						topic = broker.refused
						refused[m.UUID] = true
					} else {
						good[m.UUID] = true
					}
					if err := pub.Publish(topic, m); err != nil {
						t.Fatal(err)
					}
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			// A trickle of good rows keeps the broker's health in view: a
			// row is set aside only while the broker takes others.
			trickle := func() {
				tx := e.begin(t, t.Context())
				pub := tx.Pub
				m := message.NewMessage(watermill.NewUUID(), []byte("trickle"))
				good[m.UUID] = true
				if err := pub.Publish("review.good", m); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			deadline := time.Now().Add(60 * time.Second)
			var st outbox.Status
			for {
				if st.SetAside < int64(len(refused)) {
					trickle()
				}
				var err error
				st, err = e.ob.Status(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				got := broker.counts()
				n := 0
				for id := range good {
					if got[id] > 0 {
						n++
					}
				}
				if n == len(good) && st.Pending == 0 && st.SetAside == int64(len(refused)) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after 60s: %d of %d good rows forwarded, status %+v, want all, none pending, %d set aside", n, len(good), st, len(refused))
				}
				time.Sleep(20 * time.Millisecond)
			}
			// A relay whose first heartbeat lost to a busy SQLite is counted
			// from its next one, so only "some" is asserted.
			if st.LiveRelays < 1 {
				t.Errorf("status counts %d live relays while %d run: %+v", st.LiveRelays, len(relays), st)
			}
			for id, n := range broker.counts() {
				if good[id] && n != 1 {
					t.Errorf("row %s forwarded %d times by two relays, want once", id, n)
				}
				if refused[id] {
					t.Errorf("refused row %s counted as forwarded", id)
				}
			}
			if _, err := e.ob.Prune(t.Context(), time.Now()); err != nil {
				t.Fatal(err)
			}
			rows, err := e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != len(refused) {
				t.Errorf("%d rows set aside after a prune with no retention, want %d", len(rows), len(refused))
			}
			for _, r := range rows {
				if !refused[r.UUID] || r.Attempts < cfg.MaxAttempts {
					t.Errorf("set aside: %+v", r)
				}
			}
		})
	}
}
