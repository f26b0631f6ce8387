package outbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// failOnce fails the first publish to topic, then passes every publish on.
type failOnce struct {
	message.Publisher
	topic  string
	failed atomic.Bool
}

var errBrokerDown = errors.New("broker down")

func (p *failOnce) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.failed.CompareAndSwap(false, true) {
		return errBrokerDown
	}
	return p.Publisher.Publish(topic, msgs...)
}

// A settle row whose publish fails is retried, never set aside as foreign.
func TestFailedPublishIsRetriedNotPoisoned(t *testing.T) {
	t.Parallel()
	e := setup(t, postgresDrv)
	poisoned, err := e.pubsub.Subscribe(t.Context(), e.ob.Topic()+"_poison")
	if err != nil {
		t.Fatal(err)
	}
	placed, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	e.placeOrder(t, t.Context(), "A-9", true, message.NewMessage("retried", []byte(`{"id":"A-9"}`)))

	out := &failOnce{Publisher: e.pubsub, topic: "orders.placed"}
	r, err := e.ob.NewRelay(out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(t.Context()) }()
	<-r.Running()
	if err := r.Drain(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	if !out.failed.Load() {
		t.Fatal("the publish never failed: the test did not test anything")
	}
	if m := <-placed; m.UUID != "retried" {
		t.Fatalf("placed got %s", m.UUID)
	}
	if fwd, failed := r.Counts(); fwd != 1 || failed != 1 {
		t.Fatalf("Counts = %d forwarded, %d failed; want 1 and 1", fwd, failed)
	}
	select {
	case m := <-poisoned:
		t.Fatalf("a settle row reached the poison topic: %s", m.Payload)
	default:
	}
}

// slowBroker holds each publish until released, and says when one started.
type slowBroker struct {
	message.Publisher
	started chan struct{}
	release chan struct{}
}

func (b *slowBroker) Publish(topic string, msgs ...*message.Message) error {
	select {
	case b.started <- struct{}{}:
	default:
	}
	<-b.release
	return b.Publisher.Publish(topic, msgs...)
}

// A relay closed while it publishes still marks what it published: the
// rows are not pending afterwards, so the next relay does not send them
// again. On every database.
func TestCloseMidBatchMarksWhatWasPublished(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		e.placeOrder(t, t.Context(), "C-1", true, message.NewMessage("published", []byte(`{}`)))
		out := &slowBroker{Publisher: e.pubsub, started: make(chan struct{}, 1), release: make(chan struct{})}
		r, err := e.ob.NewRelay(out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(t.Context()) }()
		<-out.started
		closed := make(chan error, 1)
		go func() { closed <- r.Close() }()
		time.Sleep(100 * time.Millisecond) // Close has cancelled the relay's context
		close(out.release)
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		st, err := e.ob.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending != 0 {
			t.Fatalf("%d rows pending after a relay closed mid-batch had published them", st.Pending)
		}
		if fwd, _ := r.Counts(); fwd != 1 {
			t.Fatalf("Counts: %d forwarded, want 1", fwd)
		}
	})
}
