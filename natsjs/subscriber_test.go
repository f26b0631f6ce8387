package natsjs_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// A bad Config is refused before any connection is made, naming the field.
func TestConfigRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  natsjs.Config
		want string
	}{
		{natsjs.Config{}, "Config.Durable is required"},
		{natsjs.Config{Durable: "a.b"}, "Config.Durable must hold only"},
		{natsjs.Config{Durable: "a b"}, "Config.Durable must hold only"},
		{natsjs.Config{Durable: "d", AckWait: 500 * time.Millisecond}, "Config.AckWait must be >= 1s"},
		{natsjs.Config{Durable: "d", NakDelay: -2}, "Config.NakDelay must be >= 0"},
		{natsjs.Config{Durable: "d", SubscribersCount: -1}, "Config.SubscribersCount must be >= 0"},
		{natsjs.Config{Durable: "d", MaxAckPending: -1}, "Config.MaxAckPending must be >= 0"},
	} {
		_, err := natsjs.NewSubscriber("nats://127.0.0.1:1", tc.cfg, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewSubscriber(%+v) = %v, want an error containing %q", tc.cfg, err, tc.want)
		}
	}
}

// Two consumers on their own connections with one Durable share the
// topic's messages: each is handled once, by one of them.
func TestCompetingConsumers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const n = 60
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("m-%d", i), []byte("{}")))
	}
	e.publish(t, msgs...)

	var (
		mu   sync.Mutex
		by   = map[string][]int{}
		done = make(chan struct{})
	)
	for c := range 2 {
		sub := e.subscriber(t, natsjs.Config{Durable: "pool", SubscribersCount: 2, MaxAckPending: 4})
		runRouter(t, fmt.Sprintf("c%d", c), e.topic, sub, func(msg *message.Message) error {
			time.Sleep(5 * time.Millisecond)
			mu.Lock()
			defer mu.Unlock()
			by[msg.UUID] = append(by[msg.UUID], c)
			if len(by) == n {
				select {
				case <-done:
				default:
					close(done)
				}
			}
			return nil
		})
	}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
	}
	e.waitSettled(t, "pool", 5*time.Second)
	mu.Lock()
	defer mu.Unlock()
	per := [2]int{}
	for _, m := range msgs {
		got := by[m.UUID]
		if len(got) != 1 {
			t.Errorf("%s handled %d times (by %v), want once", m.UUID, len(got), got)
			continue
		}
		per[got[0]]++
	}
	if per[0] == 0 || per[1] == 0 {
		t.Errorf("messages per consumer %v: want both to take a share", per)
	}
}

// SubscribeInitialize creates nothing: it fails for a subject no stream
// takes, and passes for one a stream takes, dotted or not.
func TestSubscribeInitializeChecks(t *testing.T) {
	t.Parallel()
	e := setup(t)
	sub := e.subscriber(t, natsjs.Config{})
	for _, topic := range []string{e.topic, e.topic + ".dead_letter"} {
		if err := sub.SubscribeInitialize(topic); err != nil {
			t.Errorf("SubscribeInitialize(%q) = %v, want nil", topic, err)
		}
	}
	missing := e.topic + "_nostream"
	if err := sub.SubscribeInitialize(missing); err == nil {
		t.Errorf("SubscribeInitialize(%q) = nil, want an error: no stream takes it", missing)
	}
	if _, err := e.js.StreamInfo(missing); err == nil {
		t.Errorf("a stream %q was created", missing)
	}
	if got := sub.InFlight(); got != 1 {
		t.Errorf("InFlight() = %d, want 1", got)
	}
}

// Through a pipeline with no dedupe store, on the pipeline's default
// parking topic (dotted, inside the topic's stream): a failing handler runs
// MaxAttempts times, one copy is parked, and nothing is left unacked.
func TestPipelineDeadLetters(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.publish(t, message.NewMessage("always-fails", []byte("{}")))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(r, pipeline.Config{
		Publisher:      e.publisher(t),
		DisableTracing: true,
		Retry:          settleRetry(3),
	})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		runs int
	)
	sub := e.subscriber(t, natsjs.Config{Durable: "pipe", NakDelay: 50 * time.Millisecond})
	if _, err := p.Handle("pipe", e.topic, sub, func(*message.Message) error {
		mu.Lock()
		runs++
		mu.Unlock()
		return errors.New("downstream refuses")
	}); err != nil {
		t.Fatal(err)
	}
	runRouterOnly(t, r)

	dl := e.topic + ".dead_letter"
	deadline := time.Now().Add(15 * time.Second)
	for e.streamCount(t, dl) == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	e.waitSettled(t, "pipe", 5*time.Second)
	if n := e.streamCount(t, dl); n != 1 {
		t.Errorf("%d copies on %s, want 1", n, dl)
	}
	mu.Lock()
	defer mu.Unlock()
	if runs != 3 {
		t.Errorf("handler ran %d times, want 3", runs)
	}
}

func settleRetry(max int) middleware.RetryConfig {
	return middleware.RetryConfig{MaxAttempts: max, NoInProcessRetries: true, RedeliveryDelay: settle.NoDelay}
}

// The durable consumer outlives the subscriber that created it: a
// subscriber that starts after the first one closed takes only what the
// first did not ack, not the stream from its start.
func TestConsumerOutlivesSubscriber(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.publish(t, message.NewMessage("first", []byte("{}")))

	a, err := natsjs.NewSubscriber(e.url, natsjs.Config{Durable: "keep"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	m := next(t, subscribe(t, a, e.topic), 5*time.Second)
	m.Ack()
	e.waitSettled(t, "keep", 5*time.Second)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	e.consumerInfo(t, "keep") // fails the test when the consumer is gone

	e.publish(t, message.NewMessage("second", []byte("{}")))
	ch := subscribe(t, e.subscriber(t, natsjs.Config{Durable: "keep"}), e.topic)
	if m := next(t, ch, 5*time.Second); m.UUID != "second" {
		m.Ack()
		t.Fatalf("got %s, want second: the consumer started the stream over", m.UUID)
	} else {
		m.Ack()
	}
	e.waitSettled(t, "keep", 5*time.Second)
}
