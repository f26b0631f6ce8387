package outbox_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// flaky is a broker that can be down (every publish fails), and that drops
// its connection for a while after a publish of a "killer" message (as
// RabbitMQ does for headers past frame_max): the publishes after it fail
// too, whatever their row, until it is back.
type flaky struct {
	message.Publisher
	mu        sync.Mutex
	down      bool
	downUntil time.Time
}

var errNotConnected = errors.New("not connected to AMQP")

func (p *flaky) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	if p.down || time.Now().Before(p.downUntil) {
		p.mu.Unlock()
		return errNotConnected
	}
	for _, m := range msgs {
		if m.Metadata.Get("killer") != "" {
			p.downUntil = time.Now().Add(100 * time.Millisecond)
			p.mu.Unlock()
			return errors.New("Exception (501) Reason: \"FRAME_ERROR\"")
		}
	}
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

func (p *flaky) setDown(down bool) {
	p.mu.Lock()
	p.down = down
	p.mu.Unlock()
}

// A broker outage sets no row aside, however many attempts it takes, and
// every row is forwarded once the broker is back; a row after which the
// broker drops its connection is set aside, and the rows that failed
// behind it while it reconnected (collateral) are not. RetryInterval is
// longer than the reconnection, as the defaults are (1s against
// watermill-amqp's reconnection to a live broker).
func TestOutageSetsNothingAsideAndCollateralIsNotCharged(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		out := &flaky{Publisher: e.pubsub}
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		const maxAttempts = 3
		r := startRelay(t, e, out, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, RetryInterval: 150 * time.Millisecond, MaxRetryInterval: 300 * time.Millisecond, MaxAttempts: maxAttempts})

		// A row goes through, then the broker goes down with rows pending.
		e.publishTx(t, "orders", message.NewMessage("first", []byte(`{}`)))
		if m := <-got; m.UUID != "first" {
			t.Fatalf("got %s", m.UUID)
		} else {
			m.Ack()
		}
		out.setDown(true)
		want := map[string]bool{}
		for i := range 10 {
			id := fmt.Sprintf("during-%d", i)
			want[id] = true
			e.publishTx(t, "orders", message.NewMessage(id, []byte(`{}`)))
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			rows, err := e.ob.Failed(t.Context(), outbox.Selection{})
			if err != nil {
				t.Fatal(err)
			}
			enough := false // the rows at the head fail again and again
			for _, f := range rows {
				if !f.SetAsideAt.IsZero() {
					t.Fatalf("row %s set aside during an outage: %+v", f.UUID, f)
				}
				enough = enough || f.Attempts >= 2*maxAttempts
			}
			if enough {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("rows did not fail often enough during the outage: %+v", rows)
			}
			time.Sleep(10 * time.Millisecond)
		}
		out.setDown(false)
		for len(want) > 0 {
			select {
			case m := <-got:
				m.Ack()
				delete(want, m.UUID)
			case <-time.After(30 * time.Second):
				t.Fatalf("after the outage, %d rows not forwarded", len(want))
			}
		}
		if err := r.Drain(t.Context()); err != nil { // the batch commits after the broker has the rows
			t.Fatal(err)
		}
		if st, err := e.ob.Status(t.Context()); err != nil || st.SetAside != 0 || st.Pending != 0 {
			t.Fatalf("after the outage: %+v, %v", st, err)
		}

		// A killer row followed by good rows, again and again.
		killer := message.NewMessage("killer", []byte(`{}`))
		killer.Metadata.Set("killer", "1")
		e.publishTx(t, "orders", killer)
		for i := range 40 {
			id := fmt.Sprintf("behind-%d", i)
			want[id] = true
			e.publishTx(t, "orders", message.NewMessage(id, []byte(`{}`)))
			time.Sleep(5 * time.Millisecond)
		}
		deadline = time.Now().Add(60 * time.Second)
		for len(want) > 0 {
			select {
			case m := <-got:
				m.Ack()
				delete(want, m.UUID)
			case <-time.After(time.Until(deadline)):
				st, _ := e.ob.Status(t.Context())
				t.Fatalf("%d rows behind the killer not forwarded: %+v", len(want), st)
			}
		}
		for {
			rows, err := e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) == 1 && rows[0].UUID == "killer" {
				break
			}
			if len(rows) > 1 || time.Now().After(deadline) {
				t.Fatalf("set aside: %+v; want the killer row only", rows)
			}
			e.publishTx(t, "orders", message.NewMessage(watermill.NewUUID(), []byte(`{}`))) // traffic: the broker works
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// hangs never returns a publish of the row "hang" before the message's
// context ends (as a publisher stuck on a broker that does not answer).
type hangs struct{ message.Publisher }

func (p hangs) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.UUID == "hang" {
			<-m.Context().Done()
			return m.Context().Err()
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// A publish that outlives its batch's AckDeadline rolls the batch back, and
// its row is counted as failed in a statement of its own: it steps aside
// like any failing row (the next batch passes over it), the rows behind it
// are forwarded, and it is set aside at its MaxAttempts-th overrun.
// AckDeadline leaves a batch of one good row time to commit on a loaded
// machine: a good batch that overran would count a failure of a good row.
func TestPublishPastAckDeadlineStepsAside(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		const maxAttempts = 2
		// A row behind the hanging one is committed before the relay
		// starts: the batch after the first overrun always has a row to
		// publish, and the broker's proof that it works comes before the
		// hanging row's second overrun. (Committed only after, it can miss
		// that batch, and the row is set aside one overrun later.)
		e.publishTx(t, "orders", message.NewMessage("hang", []byte(`{}`)), message.NewMessage("behind-0", []byte(`{}`)))
		startRelay(t, e, hangs{e.pubsub}, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, AckDeadline: time.Second,
			RetryInterval: 50 * time.Millisecond, MaxRetryInterval: 100 * time.Millisecond, MaxAttempts: maxAttempts})
		deadline := time.Now().Add(2 * time.Minute)
		for i := 1; ; i++ {
			select {
			case m := <-got:
				m.Ack()
				if m.UUID == "hang" {
					t.Fatal("the hanging row was forwarded")
				}
			case <-time.After(time.Until(deadline)):
				t.Fatal("no row forwarded behind the hanging one in 2 minutes")
			}
			st, err := e.ob.Status(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if st.SetAside == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the hanging row was not set aside in 2 minutes: %+v", st)
			}
			e.publishTx(t, "orders", message.NewMessage(fmt.Sprintf("behind-%d", i), []byte(`{}`)))
		}
		rows, err := e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
		if err != nil || len(rows) != 1 || rows[0].UUID != "hang" || rows[0].Attempts != maxAttempts || !strings.Contains(rows[0].LastError, "AckDeadline") {
			t.Fatalf("set aside = %+v, %v; want the hanging row, after %d attempts, its error naming AckDeadline", rows, err, maxAttempts)
		}
	})
}
