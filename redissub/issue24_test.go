package redissub_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/redissub"
)

// afterIdleCheck is a go-redis hook that runs fn once, after an XINFO
// CONSUMERS reply that shows consumer victim idle with nothing pending:
// the moment watermill-redisstream's check of idle consumers has decided
// to delete it, before its XGROUP DELCONSUMER. It widens, to a size a test
// can hit, the window between the check and the delete. It also holds back
// every XREADGROUP of its client.
type afterIdleCheck struct {
	victim  string
	timeout time.Duration
	once    sync.Once
	fn      func()
}

func (h *afterIdleCheck) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return next(ctx, network, addr)
	}
}

func (h *afterIdleCheck) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *afterIdleCheck) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "xreadgroup" {
			// The survivor reads no new entries, so that the victim takes
			// the message; it gets entries only by claiming them.
			<-ctx.Done()
			return ctx.Err()
		}
		err := next(ctx, cmd)
		if c, ok := cmd.(*redis.XInfoConsumersCmd); ok && err == nil {
			for _, xc := range c.Val() {
				if xc.Name == h.victim && xc.Pending == 0 && xc.Idle >= h.timeout {
					h.once.Do(h.fn)
				}
			}
		}
		return err
	}
}

// Issue #24 of watermill-redisstream: its subscribers delete the group's
// consumers that have been idle for ConsumerTimeout (600s) with nothing
// pending, and XGROUP DELCONSUMER drops the entries a consumer holds. v1.4.5
// checks the pending count first (XINFO CONSUMERS), then deletes: a
// consumer that takes an entry between the two loses it from the group's
// pending list, and if it dies before acking, no one ever gets the message.
//
// A live consumer does look idle: on Redis 7.0 a read that returns nothing
// does not reset a consumer's idle time, so a consumer of a stream quiet
// for ConsumerTimeout is a candidate, alive. Here it has taken and acked
// one message (so it exists in the group), then waits; another subscriber
// of the group checks for idle consumers, decides to delete it, and before
// the delete goes out a message arrives and the live consumer takes it.
// With the package's defaults (shortened: ConsumerTimeout 1s) the entry is
// dropped; with SubscriberConfig, which never deletes a consumer, the
// survivor claims it after the victim dies.
func TestIdleConsumerDeletion(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  func(redis.UniversalClient, string) redisstream.SubscriberConfig
		lost bool
	}{
		{"package defaults lose the entry", func(c redis.UniversalClient, g string) redisstream.SubscriberConfig {
			return redisstream.SubscriberConfig{Client: c, ConsumerGroup: g,
				// The defaults (600s and 300s), shortened.
				ConsumerTimeout: time.Second, CheckConsumersInterval: 100 * time.Millisecond}
		}, true},
		{"SubscriberConfig keeps it", redissub.SubscriberConfig, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			admin := newClient(t)
			stream, group := names(t, admin)
			const timeout = time.Second
			tune := func(cfg redisstream.SubscriberConfig, consumer string) redisstream.SubscriberConfig {
				cfg.Consumer = consumer
				cfg.MaxIdleTime = 500 * time.Millisecond
				cfg.ClaimInterval = 100 * time.Millisecond
				return cfg
			}

			// The victim: a live consumer waiting on an empty stream.
			// Only the survivor checks for idle consumers (a victim that checks
			// deletes itself: the same race, in one process).
			vcfg := tune(tc.cfg(newClient(t), group), "victim")
			vcfg.CheckConsumersInterval = 100 * time.Hour
			victim := stockSub(t, vcfg)
			vch, err := victim.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}
			// It joins the group with a first message, acked.
			publish(t, admin, stream, message.NewMessage(watermill.NewUUID(), []byte("first")))
			receive(t, vch, 5*time.Second).Ack()
			waitPending(t, admin, stream, group, 0)

			// The survivor, whose check of idle consumers is watched: when it
			// has decided to delete the victim, a message is published and the
			// victim takes it, before the delete goes out.
			published := make(chan struct{})
			hook := &afterIdleCheck{victim: "victim", timeout: timeout, fn: func() {
				defer close(published)
				publish(t, admin, stream, message.NewMessage(watermill.NewUUID(), []byte("x")))
				deadline := time.Now().Add(5 * time.Second)
				for len(pendingOf(t, admin, stream, group)) == 0 && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
			}}
			sc := newClient(t)
			sc.AddHook(hook)
			// watermill-redisstream's reader sleeps 500ms after a failed read
			// (the held-back XREADGROUP), and Close does not wait for it.
			t.Cleanup(func() { time.Sleep(600 * time.Millisecond) })
			survivor := stockSub(t, tune(tc.cfg(sc, group), "survivor"))
			sch, err := survivor.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}

			select {
			case <-published:
			case <-time.After(4 * timeout):
				// The victim never looked idle: publish now, as the test would
				// have.
				hook.once.Do(hook.fn)
				<-published
			}
			// The victim takes the message and dies before acking it.
			m := receive(t, vch, 5*time.Second)
			if err := victim.Close(); err != nil {
				t.Fatal(err)
			}

			if tc.lost {
				time.Sleep(3 * timeout)
				if p := pendingOf(t, admin, stream, group); len(p) != 0 {
					t.Fatalf("entries still pending: %v; the deletion did not drop them", p)
				}
				if n := admin.XLen(t.Context(), stream).Val(); n != 2 {
					t.Fatalf("stream length %d, want 2: the message is in the stream", n)
				}
				none(t, sch, time.Second)
				t.Logf("the victim was deleted with the entry it held: the message is in the stream, pending for no one, never delivered again")
				return
			}
			got := receive(t, sch, 5*time.Second)
			if got.UUID != m.UUID {
				t.Fatalf("survivor got %s, want %s", got.UUID, m.UUID)
			}
			got.Ack()
			waitPending(t, admin, stream, group, 0)
		})
	}
}

func TestCheckSubscriberConfig(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if err := redissub.CheckSubscriberConfig(redissub.SubscriberConfig(c, "g")); err != nil {
		t.Fatalf("SubscriberConfig refused: %v", err)
	}
	for name, edit := range map[string]func(*redisstream.SubscriberConfig){
		"no client":                 func(c *redisstream.SubscriberConfig) { c.Client = nil },
		"fan-out":                   func(c *redisstream.SubscriberConfig) { c.ConsumerGroup = "" },
		"default consumer deletion": func(c *redisstream.SubscriberConfig) { c.ConsumerTimeout = 0 },
		"consumer deletion":         func(c *redisstream.SubscriberConfig) { c.ConsumerTimeout = time.Hour },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := redissub.SubscriberConfig(c, "g")
			edit(&cfg)
			if err := redissub.CheckSubscriberConfig(cfg); !errors.Is(err, redissub.ErrInvalidConfig) {
				t.Fatalf("CheckSubscriberConfig: %v, want ErrInvalidConfig", err)
			}
		})
	}
}
