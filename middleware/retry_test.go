package middleware_test

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/poison"
)

// The outcomes are checked with and without the dedupe middleware, since the
// retry middleware counts attempts from the dedupe store when it is there and
// by itself otherwise.
var counting = []struct {
	name string
	opts func(stackOpts) stackOpts
}{
	{"dedupe", func(o stackOpts) stackOpts { return o }},
	{"in-process", func(o stackOpts) stackOpts { o.noDedupe = true; return o }},
	{"republish", func(o stackOpts) stackOpts { o.noDedupe = true; o.republish = true; return o }},
}

func TestDone(t *testing.T) {
	t.Parallel()
	for _, c := range counting {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := newStack(t, c.opts(stackOpts{retry: fastRetry(3, 1)}), func(*message.Message) error { return nil })
			s.publish(message.NewMessage(watermill.NewUUID(), []byte("{}")))
			s.waitAcked(1)
			settled, dead, pois := s.snapshot()
			if s.calls.Load() != 1 || s.effects.Load() != 1 || len(settled) != 1 || len(dead)+len(pois) != 0 {
				t.Fatalf("calls=%d effects=%d deliveries=%d dead=%d poison=%d; want 1/1/1/0/0",
					s.calls.Load(), s.effects.Load(), len(settled), len(dead), len(pois))
			}
		})
	}
}

func TestRetryThenDone(t *testing.T) {
	t.Parallel()
	for _, c := range counting {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			// 3 failures with 1 in-process retry: delivery 1 runs twice,
			// delivery 2 fails once more and then succeeds in process.
			s := newStack(t, c.opts(stackOpts{retry: fastRetry(5, 1)}), failing(3, errFlaky))
			s.publish(message.NewMessage(watermill.NewUUID(), nil))
			eventually(t, 5*time.Second, "the work done", func() bool {
				settled, _, _ := s.snapshot()
				return s.effects.Load() == 1 && len(settled) == 2
			})
			settled, dead, pois := s.snapshot()
			if s.calls.Load() != 4 || s.effects.Load() != 1 {
				t.Fatalf("calls=%d effects=%d; want 4 calls and 1 effect", s.calls.Load(), s.effects.Load())
			}
			if len(settled) != 2 || !errors.Is(settled[0], errFlaky) && settled[0] != nil {
				t.Fatalf("deliveries settled as %v; want a handed-back failure, then an ack", settled)
			}
			if len(dead)+len(pois) != 0 {
				t.Fatalf("%d dead-lettered, %d poisoned; want none", len(dead), len(pois))
			}
		})
	}
}

func TestDeadLetteredAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	for _, c := range counting {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			const maxAttempts = 4
			s := newStack(t, c.opts(stackOpts{retry: fastRetry(maxAttempts, 1)}), func(*message.Message) error { return errFlaky })
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":17}`))
			msg.Metadata.Set("tenant", "acme")
			before := time.Now().UTC()
			s.publish(msg)
			s.waitDeadLettered()
			settled, dead, pois := s.snapshot()
			if s.calls.Load() != maxAttempts || s.effects.Load() != 0 {
				t.Fatalf("calls=%d effects=%d; want exactly %d calls", s.calls.Load(), s.effects.Load(), maxAttempts)
			}
			if len(dead) != 1 || len(pois) != 0 {
				t.Fatalf("dead=%d poison=%d; want 1 and 0", len(dead), len(pois))
			}
			if settled[len(settled)-1] != nil {
				t.Fatalf("last delivery settled with %v; want an ack after the dead-letter", settled[len(settled)-1])
			}
			d := dead[0]
			want := map[string]string{
				settle.MetaOutcome:       string(settle.DeadLettered),
				settle.MetaReason:        errFlaky.Error(),
				settle.MetaOriginalTopic: topic,
				settle.MetaHandler:       handlerName,
				settle.MetaOriginalUUID:  msg.UUID,
				settle.MetaAttempt:       strconv.Itoa(maxAttempts),
				"tenant":                 "acme",
			}
			for k, v := range want {
				if got := d.Metadata.Get(k); got != v {
					t.Errorf("dead-letter metadata %s = %q, want %q", k, got, v)
				}
			}
			if string(d.Payload) != `{"order":17}` || d.UUID != msg.UUID {
				t.Errorf("dead-letter copy has payload %q and UUID %s; want the original's", d.Payload, d.UUID)
			}
			first, err1 := time.Parse(time.RFC3339Nano, d.Metadata.Get(settle.MetaFirstFailure))
			last, err2 := time.Parse(time.RFC3339Nano, d.Metadata.Get(settle.MetaLastFailure))
			if err1 != nil || err2 != nil || first.Before(before.Add(-time.Second)) || last.Before(first) || time.Since(last) > time.Minute {
				t.Errorf("failure times first=%q last=%q are not ordered times of this run",
					d.Metadata.Get(settle.MetaFirstFailure), d.Metadata.Get(settle.MetaLastFailure))
			}
		})
	}
}

func TestPoisonedOnFirstDelivery(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		opts    stackOpts
		handler func(*message.Message) error
		reason  string
	}{
		{"permanent", stackOpts{}, func(*message.Message) error { return poison.Permanent(errors.New("unknown currency XXX")) }, "unknown currency XXX"},
		{"decode", stackOpts{}, func(m *message.Message) error {
			var n int
			_, err := fmt.Sscan(string(m.Payload), &n)
			return poison.Decode("int", err)
		}, "cannot be decoded"},
		{"wrapped permanent", stackOpts{}, func(*message.Message) error {
			return fmt.Errorf("charging: %w", poison.Permanent(errors.New("card number invalid")))
		}, "card number invalid"},
		{"empty dedupe key", stackOpts{key: func(*message.Message) (string, error) { return "", nil }}, func(*message.Message) error { return nil }, "empty key"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.opts.retry = fastRetry(5, 2)
			s := newStack(t, c.opts, c.handler)
			msg := message.NewMessage(watermill.NewUUID(), []byte("not json"))
			s.publish(msg)
			s.waitAcked(1)
			eventually(t, 5*time.Second, "the poison copy", func() bool { _, _, p := s.snapshot(); return len(p) == 1 })
			settled, dead, pois := s.snapshot()
			wantCalls := int64(1)
			if c.opts.key != nil {
				wantCalls = 0 // the key is refused before the handler
			}
			if s.calls.Load() != wantCalls || len(settled) != 1 {
				t.Fatalf("calls=%d deliveries=%d; want %d call and 1 delivery (no retry)", s.calls.Load(), len(settled), wantCalls)
			}
			if len(pois) != 1 || len(dead) != 0 {
				t.Fatalf("poison=%d dead=%d; want 1 and 0", len(pois), len(dead))
			}
			p := pois[0]
			if p.Metadata.Get(settle.MetaOutcome) != string(settle.Poisoned) ||
				!strings.Contains(p.Metadata.Get(settle.MetaReason), c.reason) ||
				p.Metadata.Get(settle.MetaOriginalUUID) != msg.UUID ||
				p.Metadata.Get(settle.MetaOriginalTopic) != topic ||
				p.Metadata.Get(settle.MetaHandler) != handlerName {
				t.Fatalf("poison metadata = %v", p.Metadata)
			}
		})
	}
}

func TestPanicIsRetried(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	s := newStack(t, stackOpts{retry: fastRetry(5, 2)}, func(*message.Message) error {
		if n.Add(1) == 1 {
			panic("nil map write")
		}
		return nil
	})
	s.publish(message.NewMessage(watermill.NewUUID(), nil))
	s.waitAcked(1)
	_, dead, pois := s.snapshot()
	if s.calls.Load() != 2 || s.effects.Load() != 1 || len(dead)+len(pois) != 0 {
		t.Fatalf("calls=%d effects=%d dead=%d poison=%d; want 2/1/0/0", s.calls.Load(), s.effects.Load(), len(dead), len(pois))
	}
}

func TestPanicEveryTimeIsDeadLettered(t *testing.T) {
	t.Parallel()
	s := newStack(t, stackOpts{retry: fastRetry(3, 2)}, func(*message.Message) error { panic("always") })
	s.publish(message.NewMessage(watermill.NewUUID(), nil))
	s.waitDeadLettered()
	_, dead, _ := s.snapshot()
	if s.calls.Load() != 3 || len(dead) != 1 || !strings.Contains(dead[0].Metadata.Get(settle.MetaReason), "handler panicked: always") {
		t.Fatalf("calls=%d dead=%d; want 3 calls and one dead-letter with the panic as reason", s.calls.Load(), len(dead))
	}
}

// flakyPublisher fails its first n publishes.
type flakyPublisher struct {
	message.Publisher
	fail     atomic.Int64
	attempts atomic.Int64
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.attempts.Add(1)
	if p.fail.Add(-1) >= 0 {
		return errors.New("broker unreachable")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func TestDeadLetterPublishFailureNacksThenSucceeds(t *testing.T) {
	t.Parallel()
	for _, c := range counting[:2] {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pub := &flakyPublisher{}
			pub.fail.Store(2)
			o := c.opts(stackOpts{retry: fastRetry(3, 0), parkPub: pub})
			s := newStack(t, o, func(*message.Message) error { return errFlaky })
			pub.Publisher = s.pubsub
			s.publish(message.NewMessage(watermill.NewUUID(), nil))
			s.waitDeadLettered()
			settled, dead, _ := s.snapshot()
			if len(dead) != 1 {
				t.Fatalf("dead=%d; want 1 once the publisher recovered", len(dead))
			}
			if got := dead[0].Metadata.Get(settle.MetaReason); got != errFlaky.Error() {
				t.Fatalf("dead-letter reason = %q; want the handler's last error %q", got, errFlaky.Error())
			}
			if pub.attempts.Load() != 3 {
				t.Fatalf("%d publish attempts; want 3 (two failed, one stored)", pub.attempts.Load())
			}
			nacked := 0
			for _, err := range settled {
				if err != nil && strings.Contains(err.Error(), "broker unreachable") {
					nacked++
				}
			}
			if nacked != 2 {
				t.Fatalf("deliveries settled as %v; want 2 nacks for the failed publishes", settled)
			}
			if s.calls.Load() != 3 {
				t.Fatalf("calls=%d; the handler must not run again after its attempts are used up", s.calls.Load())
			}
		})
	}
}

func TestDeferredIsNotAnAttempt(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var started atomic.Int64
	s := newStack(t, stackOpts{retry: fastRetry(2, 0)}, func(*message.Message) error {
		if started.Add(1) == 1 {
			<-release
		}
		return nil
	})
	uuid := watermill.NewUUID()
	s.publish(message.NewMessage(uuid, nil), message.NewMessage(uuid, nil))
	// The second copy finds the key busy and is deferred, several times.
	eventually(t, 5*time.Second, "deferrals", func() bool {
		settled, _, _ := s.snapshot()
		busy := 0
		for _, err := range settled {
			if errors.Is(err, dedupe.ErrBusy) {
				busy++
			}
		}
		return busy >= 3
	})
	close(release)
	s.waitAcked(2)
	_, dead, _ := s.snapshot()
	if s.calls.Load() != 1 || len(dead) != 0 {
		t.Fatalf("calls=%d dead=%d; want the handler once and no dead-letter (deferrals are not attempts)", s.calls.Load(), len(dead))
	}
}

// Watermill issues #645/#580: with Watermill's own middleware, a poison queue
// placed inside the retry catches the first failure, and nothing is retried.
// settle's order puts the terminal middleware outside the retry.
func TestOrderMatters(t *testing.T) {
	t.Parallel()
	t.Run("watermill poison queue inside retry parks the first failure", func(t *testing.T) {
		t.Parallel()
		parked := &countingPublisher{}
		pq, err := wmw.PoisonQueue(parked, poisonTopic)
		must(t, err)
		r := wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}
		wrongOrder := func(h message.HandlerFunc) message.HandlerFunc { return r.Middleware(pq(h)) }
		s := newStack(t, stackOpts{retry: fastRetry(1, 0), noDedupe: true, extraInner: wrongOrder}, failing(1, errFlaky))
		s.publish(message.NewMessage(watermill.NewUUID(), nil))
		s.waitAcked(1)
		if s.calls.Load() != 1 || s.effects.Load() != 0 || parked.n.Load() != 1 {
			t.Fatalf("calls=%d effects=%d parked=%d; want the message parked after one call, its work never done",
				s.calls.Load(), s.effects.Load(), parked.n.Load())
		}
	})
	t.Run("settle retries first and dead-letters last", func(t *testing.T) {
		t.Parallel()
		s := newStack(t, stackOpts{retry: fastRetry(3, 2)}, failing(1, errFlaky))
		s.publish(message.NewMessage(watermill.NewUUID(), nil))
		s.waitAcked(1)
		_, dead, pois := s.snapshot()
		if s.calls.Load() != 2 || s.effects.Load() != 1 || len(dead)+len(pois) != 0 {
			t.Fatalf("calls=%d effects=%d parked=%d; want 2 calls, the work done, nothing parked",
				s.calls.Load(), s.effects.Load(), len(dead)+len(pois))
		}
	})
}

type countingPublisher struct{ n atomic.Int64 }

func (p *countingPublisher) Publish(string, ...*message.Message) error { p.n.Add(1); return nil }
func (p *countingPublisher) Close() error                              { return nil }
