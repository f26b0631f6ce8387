package redissub_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/redissub"
)

func newSub(t testing.TB, c redis.UniversalClient, cfg redissub.Config) *redissub.Subscriber {
	t.Helper()
	cfg.Client = c
	s, err := redissub.NewSubscriber(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestConfigRefused(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for name, cfg := range map[string]redissub.Config{
		"no client":      {ConsumerGroup: "g"},
		"no group":       {Client: c},
		"in flight":      {Client: c, ConsumerGroup: "g", InFlight: -1},
		"block":          {Client: c, ConsumerGroup: "g", BlockTime: -1},
		"idle":           {Client: c, ConsumerGroup: "g", MaxIdleTime: 50 * time.Millisecond},
		"claim interval": {Client: c, ConsumerGroup: "g", ClaimInterval: -time.Second},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := redissub.NewSubscriber(cfg, nil); !errors.Is(err, redissub.ErrInvalidConfig) {
				t.Fatalf("NewSubscriber: %v, want ErrInvalidConfig", err)
			}
		})
	}
}

// A first delivery carries count 1 and this process's mark, whatever the
// producer wrote under the same keys.
func TestFirstDeliveryCount(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	forged := message.NewMessage(watermill.NewUUID(), []byte("x"))
	forged.Metadata.Set(settle.MetaDeliveryCount, "50")
	forged.Metadata.Set("settle_delivery_count_mark", "forged")
	forged.Metadata.Set(settle.MetaRedelivered, "true")
	publish(t, c, stream, forged)

	sub := newSub(t, c, redissub.Config{ConsumerGroup: group})
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch, 5*time.Second)
	if got := m.Metadata.Get(settle.MetaDeliveryCount); got != "1" {
		t.Errorf("delivery count %q, want 1", got)
	}
	if got := m.Metadata.Get(settle.MetaRedelivered); got != "false" {
		t.Errorf("redelivered %q, want false", got)
	}
	if m.Metadata.Get("settle_delivery_count_mark") == "forged" {
		t.Error("the producer's mark was passed on")
	}
	m.Ack()
	waitPending(t, c, stream, group, 0)
}

func waitPending(t testing.TB, c redis.UniversalClient, stream, group string, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p := pendingOf(t, c, stream, group)
		if len(p) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d entries pending, want %d: %v", len(p), n, p)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A dead consumer's entry is claimed after MaxIdleTime, with the count of
// deliveries Redis kept: the dead consumer's read and the claim.
func TestClaimedDeliveryCount(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	if err := c.XGroupCreateMkStream(t.Context(), stream, group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	// Two consumers read the entry and die without acking it: the second
	// claims it from the first.
	if err := c.XReadGroup(t.Context(), &redis.XReadGroupArgs{Group: group, Consumer: "dead-1", Streams: []string{stream, ">"}, Count: 1, Block: -1}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.XClaim(t.Context(), &redis.XClaimArgs{Stream: stream, Group: group, Consumer: "dead-2", Messages: []string{pendingOf(t, c, stream, group)[0].ID}}).Err(); err != nil {
		t.Fatal(err)
	}

	sub := newSub(t, c, redissub.Config{ConsumerGroup: group, MaxIdleTime: 500 * time.Millisecond, ClaimInterval: 100 * time.Millisecond})
	start := time.Now()
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch, 5*time.Second)
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("claimed after %v, before MaxIdleTime", d)
	}
	if got := m.Metadata.Get(settle.MetaDeliveryCount); got != "3" {
		t.Errorf("delivery count %q, want 3", got)
	}
	if got := m.Metadata.Get(settle.MetaRedelivered); got != "true" {
		t.Errorf("redelivered %q, want true", got)
	}
	m.Ack()
	waitPending(t, c, stream, group, 0)
}

// A nack hands the entry back at once, counted by Redis as a delivery.
func TestNackCounts(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	sub := newSub(t, c, redissub.Config{ConsumerGroup: group})
	ch, err := sub.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	for want := 1; want <= 3; want++ {
		m := receive(t, ch, 2*time.Second)
		if got := m.Metadata.Get(settle.MetaDeliveryCount); got != strconv.Itoa(want) {
			t.Fatalf("delivery %d: count %q", want, got)
		}
		if p := pendingOf(t, c, stream, group); len(p) != 1 || p[0].RetryCount != int64(want) {
			t.Fatalf("delivery %d: pending %v", want, p)
		}
		if want < 3 {
			m.Nack()
		} else {
			m.Ack()
		}
	}
	waitPending(t, c, stream, group, 0)
}

// Two subscribers of one group, each on its own client, share the entries:
// each is delivered to one of them, and each gets some.
func TestCompetingConsumers(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	const n = 200
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
	}
	var (
		mu   sync.Mutex
		seen = map[string]int{}
		per  [2]int
	)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	for i := range 2 {
		sub := newSub(t, newClient(t), redissub.Config{ConsumerGroup: group, InFlight: 4})
		ch, err := sub.Subscribe(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range ch {
				time.Sleep(time.Millisecond)
				mu.Lock()
				seen[m.UUID]++
				per[i]++
				mu.Unlock()
				m.Ack()
			}
		}()
	}
	publish(t, c, stream, msgs...)
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		got := len(seen)
		mu.Unlock()
		if got == n || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // a second delivery would come now
	cancel()
	wg.Wait()
	if len(seen) != n {
		t.Fatalf("%d messages delivered, want %d", len(seen), n)
	}
	for id, k := range seen {
		if k != 1 {
			t.Errorf("message %s delivered %d times", id, k)
		}
	}
	if per[0] == 0 || per[1] == 0 {
		t.Errorf("one consumer got everything: %v", per)
	}
	waitPending(t, c, stream, group, 0)
}

// An entry whose handler runs longer than MaxIdleTime is not claimed by
// another consumer: the heartbeat keeps it from going idle.
func TestLongHandlerNotClaimed(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
	cfg := redissub.Config{ConsumerGroup: group, MaxIdleTime: 400 * time.Millisecond, ClaimInterval: 50 * time.Millisecond}
	first := newSub(t, c, cfg)
	ch1, err := first.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch1, 5*time.Second)
	second := newSub(t, newClient(t), cfg)
	ch2, err := second.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	none(t, ch2, 2*time.Second) // five times MaxIdleTime
	m.Ack()
	waitPending(t, c, stream, group, 0)
}

// Close abandons the entries not acked: they stay pending, and a
// subscriber started after it claims them.
func TestCloseLeavesPending(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	publish(t, c, stream, message.NewMessage(watermill.NewUUID(), []byte("x")), message.NewMessage(watermill.NewUUID(), []byte("y")))
	cfg := redissub.Config{ConsumerGroup: group, MaxIdleTime: 400 * time.Millisecond, ClaimInterval: 50 * time.Millisecond}
	first := newSub(t, c, cfg)
	ch, err := first.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	receive(t, ch, 5*time.Second).Ack()
	receive(t, ch, 5*time.Second) // not answered
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := <-ch; ok {
		t.Fatal("channel open after Close")
	}
	waitPending(t, c, stream, group, 1)
	second := newSub(t, c, cfg)
	ch2, err := second.Subscribe(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, ch2, 5*time.Second)
	if got := m.Metadata.Get(settle.MetaDeliveryCount); got != "2" {
		t.Errorf("delivery count %q, want 2", got)
	}
	m.Ack()
	waitPending(t, c, stream, group, 0)
}
