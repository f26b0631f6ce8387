package amqpsub_test

import (
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/internal/testenv"
)

func requireRabbitmqctl(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		testenv.Require(t, "SETTLE_RABBITMQCTL")
	}
}

// When the broker closes the connection while the router holds InFlight
// messages and the next delivery waits for a slot, the subscription must
// notice: the contexts of the messages in the router are cancelled (their
// deliveries go back to the queue, whatever the handlers answer), and it
// consumes again without waiting for the router to answer them.
func TestLostConnectionCancelsTheMessagesInTheRouter(t *testing.T) {
	requireRabbitmqctl(t)
	const n, inFlight = 40, 4
	f := newFixture(t, n)
	sub, name := f.namedSubscriber(t, inFlight, nil)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	var held []*message.Message
	for range inFlight {
		m := next(msgs, 10*time.Second)
		if m == nil {
			t.Fatal("no message within 10s")
		}
		held = append(held, m)
	}
	// The fifth delivery is on the client by now, waiting for a slot.
	time.Sleep(300 * time.Millisecond)
	closeConnection(t, name)

	deadline := time.Now().Add(5 * time.Second)
	for _, m := range held {
		select {
		case <-m.Context().Done():
		case <-time.After(time.Until(deadline)):
			t.Errorf("%s: its context is not cancelled 5s after the connection was closed", m.UUID)
		}
	}
	// The subscription goes on while the router still holds them.
	if m := next(msgs, 5*time.Second); m == nil {
		t.Errorf("no message within 5s of the connection being closed, with %d unanswered in the router", inFlight)
	} else {
		m.Nack()
	}
	for _, m := range held {
		m.Nack()
	}
}

// A delivery read from a channel that is lost in the meantime must not be
// handed to the router: the broker has already put it back in the queue,
// so the router would handle it twice. Here the router does not read while
// the connection is lost; every message it reads afterwards must be a
// redelivery (all ten had been delivered on the lost channel).
func TestNoDeliveryOfALostChannelReachesTheRouter(t *testing.T) {
	requireRabbitmqctl(t)
	const n = 10
	f := newFixture(t, n)
	sub, name := f.namedSubscriber(t, 4, nil)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	time.Sleep(300 * time.Millisecond) // every message is on the client
	closeConnection(t, name)
	time.Sleep(time.Second) // reconnected by now

	acked := map[string]bool{}
	for len(acked) < n {
		m := next(msgs, 10*time.Second)
		if m == nil {
			t.Fatalf("%d of %d messages within 10s", len(acked), n)
		}
		if m.Metadata.Get(amqp.MetadataRedeliveredKey) != "true" {
			t.Errorf("%s reached the router from the lost channel (not flagged redelivered)", m.UUID)
		}
		acked[m.UUID] = true
		m.Ack()
	}
}

// No delivery is acked to the broker that the router did not ack: messages
// nacked on every delivery, acks in any order, the connection closed by the
// broker twice and the subscriber closed while answers are still on their
// way. At the end every message is either acked by the router or back in the
// queue, and no channel was closed for an unknown or already acked tag.
func TestNothingAckedThatTheRouterDidNotAck(t *testing.T) {
	requireRabbitmqctl(t)
	const n, stopAt = 200, 120
	f := newFixture(t, n)
	log := &errorLog{}
	sub, name := f.namedSubscriber(t, 16, log)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)

	var (
		mu       sync.Mutex
		acked    = map[string]bool{}
		handlers sync.WaitGroup
		kills    int
		received int
	)
	deadline := time.After(30 * time.Second)
	for {
		mu.Lock()
		count := len(acked)
		mu.Unlock()
		if count >= stopAt {
			break
		}
		if kills < 2 && count >= (kills+1)*stopAt/3 {
			kills++
			closeConnection(t, name)
		}
		var m *message.Message
		select {
		case m = <-msgs:
		case <-time.After(50 * time.Millisecond):
			continue
		case <-deadline:
			t.Fatalf("after 30s %d of %d messages acked", count, stopAt)
		}
		received++
		delay := time.Duration(received%4) * time.Millisecond
		handlers.Add(1)
		go func() {
			defer handlers.Done()
			time.Sleep(delay)
			id, _ := strconv.Atoi(m.UUID[1:])
			if id%7 == 0 {
				m.Nack()
				return
			}
			mu.Lock()
			acked[m.UUID] = true
			mu.Unlock()
			m.Ack()
		}()
	}
	must(t, sub.Close()) // answers still on their way
	handlers.Wait()
	if r := f.ready(t); r+len(acked) < n {
		t.Errorf("%d messages lost: %d in the queue, %d acked by the router, of %d", n-r-len(acked), r, len(acked), n)
	}
	// The forced close reaches the client as CONNECTION_FORCED, or, when
	// the client was writing an ack at that moment, as the write's reset.
	// What must not appear is a channel the broker closed over a tag
	// (PRECONDITION_FAILED: unknown or already acked).
	if errs := log.unexpected("CONNECTION_FORCED", "connection reset by peer", "broken pipe"); len(errs) > 0 {
		t.Errorf("unexpected errors: %q", errs)
	}
}

// Reconnecting is free of data races: the subscription waits on a
// connection the broker closes three times while it is idle, and consumes
// after each. watermill-amqp v3.0.2's ConnectionWrapper assigns its
// connected channel (and connection) from its own goroutine without a lock,
// so reading them (Connected, IsConnected, Connection) from the consumer's
// goroutine while it reconnects is a data race; -race reports it in nearly
// every run of this test. Not parallel, so that a race report is charged to
// this test alone.
func TestReconnectionIsRaceFree(t *testing.T) {
	requireRabbitmqctl(t)
	f := newFixture(t, 0)
	sub, name := f.namedSubscriber(t, 4, nil)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	ch, err := f.conn.Channel()
	must(t, err)
	for i := range 3 {
		time.Sleep(200 * time.Millisecond)
		closeConnection(t, name)
		time.Sleep(500 * time.Millisecond)
		must(t, ch.PublishWithContext(t.Context(), "", f.queue, false, false, amqp091.Publishing{
			MessageId: "m" + strconv.Itoa(i), Body: []byte(`{}`),
		}))
		m := next(msgs, 10*time.Second)
		if m == nil {
			t.Fatalf("no message within 10s after the connection was closed %d times", i+1)
		}
		m.Ack()
	}
}
