package outbox_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// brokerDown fails its first publishes and records when each was tried.
type brokerDown struct {
	message.Publisher
	mu    sync.Mutex
	fails int
	tries []time.Time
}

func (b *brokerDown) Publish(topic string, msgs ...*message.Message) error {
	b.mu.Lock()
	b.tries = append(b.tries, time.Now())
	fail := len(b.tries) <= b.fails
	b.mu.Unlock()
	if fail {
		return errors.New("connection refused")
	}
	return b.Publisher.Publish(topic, msgs...)
}

// A broker outage is retried every RetryInterval, not in a hot loop, and
// the row is forwarded once the broker is back.
func TestRelayRetriesAFailedForwardAfterRetryInterval(t *testing.T) {
	t.Parallel()
	e := setup(t, sqliteDrv)
	e.placeOrder(t, t.Context(), "A-9", true, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	out := &brokerDown{Publisher: e.pubsub, fails: 2}
	const retry = 150 * time.Millisecond
	n, err := e.ob.Forward(t.Context(), out, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, RetryInterval: retry})
	if err != nil || n != 1 {
		t.Fatalf("Forward = %d, %v; want the row forwarded after the outage", n, err)
	}
	out.mu.Lock()
	defer out.mu.Unlock()
	if len(out.tries) != 3 {
		t.Fatalf("%d publish attempts, want 3 (two failed, one forwarded)", len(out.tries))
	}
	for i := 1; i < len(out.tries); i++ {
		if gap := out.tries[i].Sub(out.tries[i-1]); gap < retry*8/10 {
			t.Fatalf("attempt %d came %v after the previous one; want about RetryInterval (%v)", i+1, gap, retry)
		}
	}
}
