package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
)

const (
	topic       = "orders"
	deadTopic   = "orders.dead"
	poisonTopic = "orders.poison"
	handlerName = "charge"
)

// stack is a real router on GoChannel with settle's middleware in its order:
// observe -> poison -> dead-letter -> retry -> dedupe -> handler.
type stack struct {
	t       *testing.T
	pubsub  *gochannel.GoChannel
	calls   atomic.Int64
	effects atomic.Int64

	mu         sync.Mutex
	settled    []error // what each delivery returned to the router
	dead, pois []*message.Message
	parkedCh   chan struct{}
}

type stackOpts struct {
	retry      middleware.RetryConfig
	noDedupe   bool
	key        dedupe.KeyFunc
	parkPub    message.Publisher // publisher of parked copies; defaults to the GoChannel
	republish  bool
	extraInner message.HandlerMiddleware
	outer      message.HandlerMiddleware // outside everything, e.g. tracing
	store      dedupe.Store              // the dedupe store; defaults to a new MemoryStore
	name       string                    // the handler's name; defaults to handlerName
}

func fastRetry(maxAttempts, inProcess int) middleware.RetryConfig {
	cfg := middleware.RetryConfig{
		MaxAttempts:     maxAttempts,
		InitialInterval: time.Millisecond,
		MaxInterval:     5 * time.Millisecond,
		RedeliveryDelay: time.Millisecond,
	}
	if inProcess == 0 {
		cfg.NoInProcessRetries = true
	} else {
		cfg.InProcessRetries = inProcess
	}
	return cfg
}

func newStack(t *testing.T, o stackOpts, handler func(msg *message.Message) error) *stack {
	t.Helper()
	logger := watermill.NopLogger{}
	s := &stack{t: t, parkedCh: make(chan struct{}, 100)}
	s.pubsub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	parkPub := o.parkPub
	if parkPub == nil {
		parkPub = s.pubsub
	}
	if o.republish {
		o.retry.Republish, o.retry.RepublishKey = s.pubsub, []byte("stack test republish key")
	}
	ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: parkPub, Topic: poisonTopic, NackDelay: time.Millisecond})
	must(t, err)
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: parkPub, Topic: deadTopic, NackDelay: time.Millisecond})
	must(t, err)
	// The dedupe middleware inside counts the runs (see
	// RetryConfig.StoreCounts).
	o.retry.StoreCounts = !o.noDedupe
	rt, err := middleware.NewRetry(o.retry)
	must(t, err)
	mws := []message.HandlerMiddleware{s.observe, ps, dl, rt}
	if o.outer != nil {
		mws = append([]message.HandlerMiddleware{o.outer}, mws...)
	}
	if !o.noDedupe {
		store := o.store
		if store == nil {
			store = dedupe.NewMemoryStore()
		}
		dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, Key: o.key, BusyDelay: time.Millisecond,
			UnavailableDelay: time.Millisecond, MaxUnavailableDelay: 4 * time.Millisecond})
		must(t, err)
		mws = append(mws, dd)
	}
	if o.extraInner != nil {
		mws = append(mws, o.extraInner)
	}
	name := o.name
	if name == "" {
		name = handlerName
	}
	router.AddConsumerHandler(name, topic, s.pubsub, func(msg *message.Message) error {
		s.calls.Add(1)
		if err := handler(msg); err != nil {
			return err
		}
		s.effects.Add(1)
		return nil
	}).AddMiddleware(mws...)

	for _, c := range []struct {
		topic string
		into  *[]*message.Message
	}{{deadTopic, &s.dead}, {poisonTopic, &s.pois}} {
		msgs, err := s.pubsub.Subscribe(t.Context(), c.topic)
		must(t, err)
		go func() {
			for m := range msgs {
				s.mu.Lock()
				*c.into = append(*c.into, m)
				s.mu.Unlock()
				m.Ack()
				s.parkedCh <- struct{}{}
			}
		}()
	}

	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
		must(t, s.pubsub.Close())
	})
	return s
}

func (s *stack) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		s.mu.Lock()
		s.settled = append(s.settled, err)
		s.mu.Unlock()
		return out, err
	}
}

func (s *stack) publish(msgs ...*message.Message) {
	s.t.Helper()
	must(s.t, s.pubsub.Publish(topic, msgs...))
}

// waitAcked polls until n deliveries returned nil (were acked).
func (s *stack) waitAcked(n int) {
	s.t.Helper()
	eventually(s.t, 5*time.Second, "acked deliveries", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		acked := 0
		for _, err := range s.settled {
			if err == nil {
				acked++
			}
		}
		return acked >= n
	})
}

// waitDeadLettered polls until one copy is on the dead-letter topic and the
// delivery that put it there was acked.
func (s *stack) waitDeadLettered() {
	s.t.Helper()
	eventually(s.t, 5*time.Second, "dead-lettered and acked", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.dead) == 1 && len(s.settled) > 0 && s.settled[len(s.settled)-1] == nil
	})
}

func (s *stack) snapshot() (settled []error, dead, pois []*message.Message) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.settled...), append([]*message.Message(nil), s.dead...), append([]*message.Message(nil), s.pois...)
}

func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached within %v", what, within)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// failing returns a handler that fails its first n calls with err.
func failing(n int, err error) func(*message.Message) error {
	var calls atomic.Int64
	return func(*message.Message) error {
		if calls.Add(1) <= int64(n) {
			return err
		}
		return nil
	}
}

var errFlaky = errors.New("payment provider timed out")
