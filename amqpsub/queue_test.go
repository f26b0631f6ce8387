package amqpsub_test

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpsub"
)

// The queue is deleted by someone else while the router holds two of its
// messages: their contexts are cancelled, a late ack of theirs is harmless,
// the queue is declared again and messages published to it afterwards reach
// the router; Close returns promptly.
func TestQueueDeletedWhileConsuming(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2)
	log := &errorLog{}
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: 4}, log)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	a, b := next(msgs, 10*time.Second), next(msgs, 10*time.Second)
	if a == nil || b == nil {
		t.Fatal("fewer than 2 messages within 10s")
	}
	ch, err := f.conn.Channel()
	must(t, err)
	_, err = ch.QueueDelete(f.queue, false, false, false)
	must(t, err)
	select {
	case <-a.Context().Done():
	case <-time.After(5 * time.Second):
		t.Error("the context of a message of the deleted queue is not cancelled within 5s")
	}
	a.Ack()
	b.Nack()
	time.Sleep(time.Second) // declared again by now
	must(t, ch.PublishWithContext(t.Context(), "", f.queue, false, false, amqp091.Publishing{MessageId: "after", Body: []byte(`{}`)}))
	m := next(msgs, 5*time.Second)
	if m == nil || m.UUID != "after" {
		t.Fatalf("after the queue was deleted: got %v, want the message published afterwards", m)
	}
	m.Ack()
	time.Sleep(200 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case err := <-closed:
		must(t, err)
	case <-ctx.Done():
		t.Fatal("Close did not return within 5s")
	}
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages left in the queue", r)
	}
	t.Logf("errors logged: %q", log.unexpected())
}
