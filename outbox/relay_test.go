package outbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/testenv"
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
	e := setup(t, testenv.Postgres(t))
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
	r, err := e.ob.NewRelay(e.db.DB, out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
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
