package amqpsub_test

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpsub"
)

// One slow message must not starve the router: the first delivery is held
// unanswered while every other one is answered at once (a tenth of them
// nacked on their first delivery, so they come back), and the others keep
// coming. Acking only in delivery-tag order keeps every delivery after the
// held one unacked on the broker, which stops sending once the prefetch
// (4 × InFlight) is used up: the router is left with one message while the
// queue has plenty. Once the held one is acked too, the queue is empty and
// no channel was closed for an unknown or already acked tag.
func TestSlowMessageDoesNotStarveTheRouter(t *testing.T) {
	t.Parallel()
	const n, inFlight = 100, 4
	f := newFixture(t, n)
	log := &errorLog{}
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: inFlight}, log)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	held := next(msgs, 10*time.Second)
	if held == nil {
		t.Fatal("no message within 10s")
	}
	acked := map[string]bool{held.UUID: true}
	nacked := map[string]bool{}
	for len(acked) < n {
		m := next(msgs, 3*time.Second)
		if m == nil {
			held.Ack()
			var missing []string
			for i := range n {
				if id := "m" + strconv.Itoa(i); !acked[id] {
					missing = append(missing, id)
				}
			}
			t.Fatalf("after %d of %d messages acked, none within 3s while the first is held (%d ready in the queue; not acked yet: %v)", len(acked), n, f.ready(t), missing)
		}
		if id, _ := strconv.Atoi(m.UUID[1:]); id%10 == 5 && !nacked[m.UUID] {
			nacked[m.UUID] = true
			m.Nack()
			continue
		}
		acked[m.UUID] = true
		m.Ack()
	}
	held.Ack()
	time.Sleep(200 * time.Millisecond) // the last acks leave
	must(t, sub.Close())
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages in the queue after every one was acked", r)
	}
	if errs := log.unexpected(); len(errs) > 0 {
		t.Errorf("unexpected errors: %q", errs)
	}
}

// InFlight beyond what a prefetch count can say (a 16-bit field; 4 ×
// InFlight must fit) is refused or honoured, never truncated: with InFlight
// 16385 the prefetch 65540 became 4, and only 4 of 10 messages reached the
// router.
func TestInFlightBeyondThePrefetchField(t *testing.T) {
	t.Parallel()
	const n = 10
	f := newFixture(t, n)
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: 16385}, nil)
	if err != nil {
		return // refused
	}
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	for got := range n {
		if next(msgs, 2*time.Second) == nil {
			t.Fatalf("%d of %d messages reached the router with InFlight %d", got, n, sub.InFlight())
		}
	}
}

// badMarshaler fails to unmarshal the deliveries whose message ID number is
// 2 modulo 5.
type badMarshaler struct{ amqp.Marshaler }

func (m badMarshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	if id, _ := strconv.Atoi(d.MessageId[1:]); id%5 == 2 {
		return nil, errors.New("bad delivery")
	}
	return m.Marshaler.Unmarshal(d)
}

// Deliveries that cannot be unmarshalled are nacked at once, between
// deliveries that the router answers later in any order, some with a nack:
// the acks of several deliveries never meet an already settled tag (the
// channel would be closed with PRECONDITION_FAILED and the deliveries come
// again), and the queue is empty at the end.
func TestUnmarshalFailuresAmongAnswers(t *testing.T) {
	t.Parallel()
	const n = 300
	f := newFixture(t, n)
	f.cfg.Marshaler = badMarshaler{f.cfg.Marshaler}
	f.cfg.Consume.NoRequeueOnNack = true // the bad ones and the nacked ones are dropped
	log := &errorLog{}
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: 16}, log)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)

	want := n - n/5 // all but the bad ones reach the router
	seen := map[string]int{}
	answers := make(chan struct{}, want)
	for range want {
		m := next(msgs, 10*time.Second)
		if m == nil {
			t.Fatalf("%d of %d messages within 10s", len(seen), want)
		}
		seen[m.UUID]++
		id, _ := strconv.Atoi(m.UUID[1:])
		go func() {
			time.Sleep(time.Duration(id%4) * time.Millisecond)
			if id%5 == 0 {
				m.Nack()
			} else {
				m.Ack()
			}
			answers <- struct{}{}
		}()
	}
	for range want {
		<-answers
	}
	if m := next(msgs, 500*time.Millisecond); m != nil {
		t.Errorf("%s delivered again", m.UUID)
	}
	must(t, sub.Close())
	for id, c := range seen {
		if c != 1 {
			t.Errorf("%s delivered %d times", id, c)
		}
	}
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages in the queue, want 0", r)
	}
	if errs := log.unexpected("bad delivery"); len(errs) > 0 {
		t.Errorf("unexpected errors: %q", errs)
	}
}
