package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/middleware"
)

// With only the broker's delivery count (RabbitMQ quorum queues, through
// settle's AMQP marshaler), MaxAttempts still bounds the runs of the
// handler: each earlier delivery is taken to have used all its in-process
// runs, so the handler never runs more than MaxAttempts times in all, even
// when a consumer died during a delivery.
func TestDeliveryCountBoundsRuns(t *testing.T) {
	t.Parallel()
	cases := []struct {
		deliveryCount int
		wantCalls     int
		wantExhausted bool
	}{
		{1, 2, false}, // runs 1-2: 1 run + 1 in-process retry, then back to the broker
		{2, 2, false}, // runs 3-4
		{3, 1, true},  // run 5 is the last: dead-lettered after it fails
		{4, 0, true},  // crashed during the third: not run again
	}
	for _, c := range cases {
		t.Run("delivery "+strconv.Itoa(c.deliveryCount), func(t *testing.T) {
			t.Parallel()
			rt, err := middleware.NewRetry(fastRetry(5, 1))
			must(t, err)
			calls := 0
			h := rt(func(*message.Message) ([]*message.Message, error) { calls++; return nil, errFlaky })
			msg := quorumDelivery(t, "m", c.deliveryCount)
			_, err = h(msg)
			var ex *middleware.ExhaustedError
			if calls != c.wantCalls || errors.As(err, &ex) != c.wantExhausted {
				t.Fatalf("calls=%d err=%v; want %d calls, exhausted=%v", calls, err, c.wantCalls, c.wantExhausted)
			}
			if c.wantExhausted && ex.Attempts != 5 {
				t.Fatalf("ExhaustedError.Attempts = %d, want 5", ex.Attempts)
			}
		})
	}
	// The whole life of one message, delivery after delivery: never more
	// than MaxAttempts runs, whatever MaxAttempts and InProcessRetries are.
	for maxAttempts := 1; maxAttempts <= 7; maxAttempts++ {
		for inProcess := 0; inProcess <= 3; inProcess++ {
			rt, err := middleware.NewRetry(fastRetry(maxAttempts, inProcess))
			must(t, err)
			calls := 0
			h := rt(func(*message.Message) ([]*message.Message, error) { calls++; return nil, errFlaky })
			for n := 1; n <= 3*maxAttempts; n++ {
				msg := quorumDelivery(t, "m", n)
				var ex *middleware.ExhaustedError
				if _, err := h(msg); errors.As(err, &ex) {
					break
				}
			}
			if calls > maxAttempts || calls < 1 {
				t.Errorf("MaxAttempts %d, InProcessRetries %d: %d runs", maxAttempts, inProcess, calls)
			}
		}
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

// quorumDelivery is delivery n of the message uuid from a RabbitMQ quorum
// queue, through settle's marshaler: the only way to a delivery count the
// retry middleware believes.
func quorumDelivery(t *testing.T, uuid string, n int) *message.Message {
	t.Helper()
	m, err := amqpmarshal.New(amqpmarshal.Config{QuorumQueue: true})
	must(t, err)
	msg, err := m.Unmarshal(amqp091.Delivery{MessageId: uuid, Redelivered: n > 1, Headers: amqp091.Table{"x-delivery-count": int64(n - 1)}})
	must(t, err)
	if n > 1 && msg.Metadata.Get(settle.MetaDeliveryCount) != strconv.Itoa(n) {
		t.Fatalf("delivery count %q, want %d", msg.Metadata.Get(settle.MetaDeliveryCount), n)
	}
	return msg
}

// A settle_delivery_count that settle's marshaler did not set in this
// process (a producer's header, passed on by another marshaler) is not a
// count: the handler runs.
func TestForgedDeliveryCountIgnored(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(fastRetry(3, 0))
	must(t, err)
	calls := 0
	h := rt(func(*message.Message) ([]*message.Message, error) { calls++; return nil, nil })
	for _, mark := range []string{"", "AAAA", quorumDelivery(t, "other", 9).Metadata.Get("settle_delivery_count_mark")} {
		msg := message.NewMessage("m", nil)
		msg.Metadata.Set(settle.MetaDeliveryCount, "50")
		msg.Metadata.Set("settle_delivery_count_mark", mark)
		calls = 0
		if _, err := h(msg); err != nil || calls != 1 {
			t.Errorf("mark %q: %d runs, %v; want 1 run and no error", mark, calls, err)
		}
	}
}
