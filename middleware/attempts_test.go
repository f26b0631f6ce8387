package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// With only the broker's delivery count (RabbitMQ quorum queues, through
// settle's AMQP marshaler), an attempt is a delivery: in-process retries do
// not add to it, and a delivery arriving with MaxAttempts deliveries behind it
// is not run at all, because the consumer died during each of those.
func TestDeliveryCountIsTheAttempt(t *testing.T) {
	t.Parallel()
	cfg := fastRetry(3, 2)
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	cases := []struct {
		deliveryCount int
		wantCalls     int
		wantExhausted bool
	}{
		{1, 3, false}, // first delivery: 1 run + 2 in-process retries, then back to the broker
		{2, 3, false},
		{3, 1, true}, // the third delivery is the last attempt: dead-lettered after its first failure
		{4, 0, true}, // crashed during the third: not run again
	}
	for _, c := range cases {
		t.Run("delivery "+strconv.Itoa(c.deliveryCount), func(t *testing.T) {
			t.Parallel()
			calls := 0
			h := rt(func(*message.Message) ([]*message.Message, error) { calls++; return nil, errFlaky })
			msg := message.NewMessage("m", nil)
			msg.Metadata.Set(settle.MetaDeliveryCount, strconv.Itoa(c.deliveryCount))
			_, err := h(msg)
			var ex *middleware.ExhaustedError
			if calls != c.wantCalls || errors.As(err, &ex) != c.wantExhausted {
				t.Fatalf("calls=%d err=%v; want %d calls, exhausted=%v", calls, err, c.wantCalls, c.wantExhausted)
			}
			if c.wantExhausted && ex.Attempts != 3 {
				t.Fatalf("ExhaustedError.Attempts = %d, want 3", ex.Attempts)
			}
		})
	}
}

func TestBackoffHonoursCancellation(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(middleware.RetryConfig{MaxAttempts: 10, InitialInterval: time.Hour, MaxInterval: time.Hour})
	must(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	msg := message.NewMessage("m", nil)
	msg.SetContext(ctx)
	h := rt(func(*message.Message) ([]*message.Message, error) { cancel(); return nil, errFlaky })
	start := time.Now()
	_, err = h(msg)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errFlaky) {
		t.Fatalf("err = %v; want the failure joined with context.Canceled", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatal("the backoff did not stop on cancellation")
	}
}

func TestAttemptVisibleToHandler(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(fastRetry(5, 2))
	must(t, err)
	var seen []string
	h := rt(func(m *message.Message) ([]*message.Message, error) {
		seen = append(seen, m.Metadata.Get(settle.MetaAttempt))
		if len(seen) < 3 {
			return nil, errFlaky
		}
		return nil, nil
	})
	if _, err := h(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 3 || seen[0] != "1" || seen[1] != "2" || seen[2] != "3" {
		t.Fatalf("handler saw attempts %v; want [1 2 3]", seen)
	}
}
