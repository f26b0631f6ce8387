package redissub_test

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/redissub"
)

// stockSub returns watermill-redisstream's subscriber of cfg, closed at
// the test's end.
func stockSub(t testing.TB, cfg redisstream.SubscriberConfig) *redisstream.Subscriber {
	t.Helper()
	if cfg.ShouldStopOnReadErrors == nil {
		// Its reader sleeps 500ms after the read Close makes fail, and
		// Close does not wait for it (SubscriberConfig stops it at once).
		t.Cleanup(func() { time.Sleep(600 * time.Millisecond) })
	}
	s, err := redisstream.NewSubscriber(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// watermill-redisstream answers a nack in the process: the same message is
// handed to the router again at once (NackResendSleep, default none), and
// Redis does not hear of it: the entry's delivery count stays 1 and its
// idle time keeps growing. Once it has been idle MaxIdleTime it is claimed
// while still in the router (here by the same subscriber, whose claim loop
// does not know its own entries), and delivered again after the first
// delivery was acked: a handler that runs longer than MaxIdleTime gets its
// message a second time (settle's dedupe answers it as a duplicate).
func TestStockNack(t *testing.T) {
	t.Parallel()
	admin := newClient(t)
	stream, group := names(t, admin)
	publish(t, admin, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	cfg := redissub.SubscriberConfig(newClient(t), group)
	cfg.MaxIdleTime = time.Second
	cfg.ClaimInterval = 100 * time.Millisecond
	sub := stockSub(t, cfg)
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch, 5*time.Second)
	for range 5 {
		start := time.Now()
		m.Nack()
		m = receive(t, ch, time.Second)
		if d := time.Since(start); d > 50*time.Millisecond {
			t.Errorf("redelivered after a nack in %v, want at once", d)
		}
	}
	if p := pendingOf(t, admin, stream, group); len(p) != 1 || p[0].RetryCount != 1 {
		t.Fatalf("pending %v, want one entry delivered once: Redis heard of no nack", p)
	}

	// The handler runs past MaxIdleTime.
	time.Sleep(1500 * time.Millisecond)
	if p := pendingOf(t, admin, stream, group); len(p) != 1 || p[0].RetryCount < 2 {
		t.Fatalf("pending %v, want the entry claimed while its message is in the router", p)
	}
	m.Ack()
	again := receive(t, ch, 3*time.Second)
	if again.UUID != m.UUID {
		t.Fatalf("got %s, want %s again", again.UUID, m.UUID)
	}
	again.Ack()
	waitPending(t, admin, stream, group, 0)
}

// One watermill-redisstream subscription hands the router one entry at a
// time: the next is read only when the one before it was acked. One
// redissub subscription hands over InFlight entries before any is acked.
func TestInFlightPerSubscription(t *testing.T) {
	t.Parallel()
	for _, stock := range []bool{true, false} {
		name := map[bool]string{true: "watermill-redisstream", false: "redissub"}[stock]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			admin := newClient(t)
			stream, group := names(t, admin)
			for range 4 {
				publish(t, admin, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
			}
			var sub message.Subscriber
			if stock {
				sub = stockSub(t, redissub.SubscriberConfig(newClient(t), group))
			} else {
				sub = newSub(t, admin, redissub.Config{ConsumerGroup: group, InFlight: 3})
			}
			ch, err := sub.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}
			var held []*message.Message
			held = append(held, receive(t, ch, 5*time.Second))
			if stock {
				none(t, ch, 300*time.Millisecond)
			} else {
				held = append(held, receive(t, ch, time.Second), receive(t, ch, time.Second))
				none(t, ch, 300*time.Millisecond) // InFlight reached
			}
			held[0].Ack()
			next := receive(t, ch, 2*time.Second)
			next.Ack()
			for _, m := range held[1:] {
				m.Ack()
			}
			if stock { // two of the four left
				receive(t, ch, 2*time.Second).Ack()
				receive(t, ch, 2*time.Second).Ack()
			}
			waitPending(t, admin, stream, group, 0)
		})
	}
}

// With SubscriberConfig, no reader of watermill-redisstream's subscriber is
// left once Close has returned: the read that Close makes fail stops it,
// where the package's own config sleeps 500ms first.
func TestStockCloseLeavesNoReader(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		cfg   func(redis.UniversalClient, string) redisstream.SubscriberConfig
		wants bool // a reader still there right after Close
	}{
		{"SubscriberConfig", redissub.SubscriberConfig, false},
		{"package defaults", func(c redis.UniversalClient, g string) redisstream.SubscriberConfig {
			return redisstream.SubscriberConfig{Client: c, ConsumerGroup: g, DisableIndefiniteInitialBlock: true}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newClient(t)
			stream, group := names(t, c)
			publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
			sub := stockSub(t, tc.cfg(c, group))
			ch, err := sub.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}
			receive(t, ch, 5*time.Second).Ack()
			// The reader is now blocked in XREADGROUP on the empty stream.
			time.Sleep(50 * time.Millisecond)
			if err := sub.Close(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond)
			if got := readerOf(sub); got != tc.wants {
				t.Fatalf("a reader left 100ms after Close: %v, want %v", got, tc.wants)
			}
		})
	}
}

// readerOf reports whether a goroutine of watermill-redisstream's reader
// is running for sub, the read method's receiver, whose address the
// goroutines' stacks show as its first argument.
func readerOf(sub *redisstream.Subscriber) bool {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	return bytes.Contains(buf, fmt.Appendf(nil, "redisstream.(*Subscriber).read(%p,", sub))
}
