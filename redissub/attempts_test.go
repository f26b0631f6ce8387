package redissub_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/redissub"
)

// retryHandler is the retry middleware, with no dedupe store counting, in
// front of a handler that counts its runs.
func retryHandler(t testing.TB, maxAttempts int) (message.HandlerFunc, *int) {
	t.Helper()
	rt, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts: maxAttempts, NoInProcessRetries: true,
		InitialInterval: settle.NoDelay, RedeliveryDelay: settle.NoDelay,
	})
	if err != nil {
		t.Fatal(err)
	}
	runs := new(int)
	return rt(func(*message.Message) ([]*message.Message, error) { *runs++; return nil, nil }), runs
}

// A producer's settle_delivery_count passes through both subscribers'
// unmarshaler into the message; the retry middleware must not take it for
// a count: the handler runs, the message is not dead-lettered unrun.
func TestForgedDeliveryCountRuns(t *testing.T) {
	t.Parallel()
	for _, stock := range []bool{true, false} {
		name := map[bool]string{true: "watermill-redisstream", false: "redissub"}[stock]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := newClient(t)
			stream, group := names(t, c)
			forged := message.NewMessage(watermill.NewUUID(), []byte("x"))
			forged.Metadata.Set(settle.MetaDeliveryCount, "50")
			forged.Metadata.Set("settle_delivery_count_mark", "AAAA")
			publish(t, c, stream, forged)

			var sub message.Subscriber
			if stock {
				sub = stockSub(t, redissub.SubscriberConfig(newClient(t), group))
			} else {
				sub = newSub(t, c, redissub.Config{ConsumerGroup: group})
			}
			ch, err := sub.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}
			m := receive(t, ch, 5*time.Second)
			if stock && m.Metadata.Get(settle.MetaDeliveryCount) != "50" {
				t.Fatalf("watermill-redisstream did not pass the producer's count on (%q): the test proves nothing", m.Metadata.Get(settle.MetaDeliveryCount))
			}
			h, runs := retryHandler(t, 3)
			if _, err := h(m); err != nil || *runs != 1 {
				t.Fatalf("%d runs, err %v; want 1 run and no error", *runs, err)
			}
			m.Ack()
			waitPending(t, c, stream, group, 0)
		})
	}
}

// A message that kills every consumer it is delivered to (here: read by
// consumers that never answer) reaches the dead-letter by Redis's
// delivery count, without a store and across processes: the subscriber
// that claims it after MaxAttempts deliveries hands the retry middleware a
// count it believes, and the handler is not run again.
func TestCrashLoopDeadLettersByDeliveryCount(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	if err := c.XGroupCreateMkStream(t.Context(), stream, group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	const maxAttempts = 3
	if err := c.XReadGroup(t.Context(), &redis.XReadGroupArgs{Group: group, Consumer: "dead-1", Streams: []string{stream, ">"}, Count: 1, Block: -1}).Err(); err != nil {
		t.Fatal(err)
	}
	id := pendingOf(t, c, stream, group)[0].ID
	for i := 2; i <= maxAttempts; i++ {
		if err := c.XClaim(t.Context(), &redis.XClaimArgs{Stream: stream, Group: group, Consumer: "dead-" + string(rune('0'+i)), Messages: []string{id}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	sub := newSub(t, c, redissub.Config{ConsumerGroup: group, MaxIdleTime: 400 * time.Millisecond, ClaimInterval: 50 * time.Millisecond})
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch, 5*time.Second)
	h, runs := retryHandler(t, maxAttempts)
	_, err = h(m)
	var ex *middleware.ExhaustedError
	if !errors.As(err, &ex) || *runs != 0 {
		t.Fatalf("%d runs, err %v; want no run and an ExhaustedError", *runs, err)
	}
	if ex.Attempts != maxAttempts {
		t.Errorf("attempts %d, want %d", ex.Attempts, maxAttempts)
	}
	m.Ack()
	waitPending(t, c, stream, group, 0)
}

// Redis has no delayed nack: the retry middleware holds a failed delivery
// for RedeliveryDelay and then nacks it, and the subscriber hands it back at
// once, counted by Redis. The second delivery's count reaches a retry
// middleware of another process (a fresh one here, with no memory of the
// first run), which makes it the last attempt and dead-letters it.
func TestRedeliveryDelayAndCount(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	sub := newSub(t, c, redissub.Config{ConsumerGroup: group})
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	const delay = 300 * time.Millisecond
	var runs []time.Time
	fail := func(*message.Message) ([]*message.Message, error) {
		runs = append(runs, time.Now())
		return nil, errors.New("boom")
	}
	newRetry := func() message.HandlerFunc {
		rt, err := middleware.NewRetry(middleware.RetryConfig{
			MaxAttempts: 2, NoInProcessRetries: true,
			InitialInterval: settle.NoDelay, RedeliveryDelay: delay, RandomizationFactor: middleware.NoJitter,
		})
		if err != nil {
			t.Fatal(err)
		}
		return rt(fail)
	}

	m := receive(t, ch, 5*time.Second)
	if _, err := newRetry()(m); err == nil {
		t.Fatal("first delivery: no error")
	}
	m.Nack()
	m = receive(t, ch, time.Second)
	nacked := time.Now()
	if got := m.Metadata.Get(settle.MetaDeliveryCount); got != "2" {
		t.Fatalf("second delivery: count %q, want 2", got)
	}
	_, err = newRetry()(m)
	var ex *middleware.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 2 {
		t.Fatalf("second delivery: %v, want an ExhaustedError after 2 attempts", err)
	}
	if len(runs) != 2 {
		t.Fatalf("%d runs, want 2", len(runs))
	}
	if gap := nacked.Sub(runs[0]); gap < delay {
		t.Errorf("redelivered %v after the failed run, want at least RedeliveryDelay %v", gap, delay)
	}
	m.Ack()
	waitPending(t, c, stream, group, 0)
}
