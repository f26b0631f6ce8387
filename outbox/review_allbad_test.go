package outbox_test

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

type refuseAll struct{ calls atomic.Int64 }

func (p *refuseAll) Publish(string, ...*message.Message) error {
	p.calls.Add(1)
	return errors.New("review: refused")
}
func (p *refuseAll) Close() error { return nil }

// review: an outbox where every row is refused (no good traffic to show
// that the broker works): the relay does not spin (publishes are paced by
// RetryInterval), sets nothing aside, and Status and Failed show rows
// retrying with the broker's error. (Most failures then count for no row,
// as after another failure the broker may be down: the oldest row itself
// may show no attempt.)
func TestReviewEveryRowRefused(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		p := &refuseAll{}
		const retry = 100 * time.Millisecond
		_ = startRelay(t, e, p, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, RetryInterval: retry, MaxRetryInterval: 4 * retry, MaxAttempts: 2})
		for i := range 20 {
			e.publishTx(t, "refused", message.NewMessage(fmt.Sprintf("bad-%d", i), []byte(`{}`)))
		}
		const watch = 2 * time.Second
		time.Sleep(watch)
		calls := p.calls.Load()
		// Two publishes per pause at most (a failure, then the one that
		// stops the batch), plus the first batch.
		if max := int64(watch/retry)*2 + 4; calls > max {
			t.Errorf("%d publishes in %v, want at most %d: the relay spins", calls, watch, max)
		}
		st, err := e.ob.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%d publishes; status %+v", calls, st)
		if st.SetAside != 0 {
			t.Errorf("rows set aside with no sign that the broker works: %+v", st)
		}
		if st.Retrying == 0 || st.Pending != 20 {
			t.Errorf("status %+v: want 20 pending, some retrying", st)
		}
		// What settle outbox status -list shows: some rows with the
		// broker's error.
		rows, err := e.ob.Failed(t.Context(), outbox.Selection{})
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) == 0 || rows[0].LastError == "" {
			t.Errorf("no failed row shows why: %+v", rows)
		}
	})
}
