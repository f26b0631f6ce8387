package amqpsub_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
)

// Misuse that must be refused or behave: a negative InFlight, InFlight 1,
// Close twice, Subscribe after Close.
func TestMisuse(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 4)
	if _, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: -1}, nil); err == nil {
		t.Error("InFlight -1 accepted")
	}

	sub := f.subscriber(t, 1)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	first := next(msgs, 10*time.Second)
	if first == nil {
		t.Fatal("no message within 10s")
	}
	if m := next(msgs, 300*time.Millisecond); m != nil {
		t.Errorf("InFlight 1: %s reached the router while %s was unanswered", m.UUID, first.UUID)
	}
	must(t, sub.Close())
	must(t, sub.Close())
	if _, ok := <-msgs; ok {
		t.Error("a message after Close")
	}
	if _, err := sub.Subscribe(t.Context(), f.queue); err == nil {
		t.Error("Subscribe after Close: no error")
	}
	if r := f.ready(t); r != 4 {
		t.Errorf("%d messages in the queue after Close, want 4", r)
	}
}

// SubscribeInitialize after Close is an error, and does not read the
// wrapper's connected channel, which the wrapper's goroutine rewrites when
// it stops: under -race that read is a data race. Not parallel, so that a
// race report is not charged to other tests.
func TestSubscribeInitializeAfterClose(t *testing.T) {
	f := newFixture(t, 0)
	sub := f.subscriber(t, 4)
	must(t, sub.Close())
	if err := sub.SubscribeInitialize(f.queue); err == nil {
		t.Error("SubscribeInitialize after Close: no error")
	}
}

// Two subscriptions of one subscriber (one with a prefetch below InFlight,
// which is raised), each with InFlight messages held unanswered and no more
// reaching the router; one's context is cancelled, then the subscriber is
// closed: both message channels close, Close returns, and every message is
// back in its queue.
func TestCloseWithUnansweredMessagesAndAnUnreadChannel(t *testing.T) {
	t.Parallel()
	const n, inFlight = 30, 4
	f1, f2 := newFixture(t, n), newFixture(t, n)
	f1.cfg.Consume.Qos.PrefetchCount = 2 // below InFlight: raised
	sub := f1.subscriber(t, inFlight)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	m1, err := sub.Subscribe(ctx, f1.queue)
	must(t, err)
	m2, err := sub.Subscribe(t.Context(), f2.queue)
	must(t, err)
	for i, msgs := range []<-chan *message.Message{m1, m2} {
		for range inFlight {
			if next(msgs, 10*time.Second) == nil {
				t.Fatalf("subscription %d: fewer than %d messages within 10s", i+1, inFlight)
			}
		}
		if m := next(msgs, 300*time.Millisecond); m != nil {
			t.Errorf("subscription %d: %s beyond InFlight %d", i+1, m.UUID, inFlight)
		}
	}
	cancel()
	if m := next(m1, 5*time.Second); m != nil {
		t.Errorf("%s after the subscription's context was cancelled", m.UUID)
	}
	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case err := <-closed:
		must(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10s")
	}
	for _, f := range []*fixture{f1, f2} {
		if r := f.ready(t); r != n {
			t.Errorf("%s: %d messages in the queue after Close, want %d", f.queue, r, n)
		}
	}
}

// amqp091's own connection recovery (amqp091.Config.Recovery) must not be
// combined with the wrapper's reconnection: after the broker closes the
// connection, both reconnect, and Close closes only the wrapper's. Either
// the configuration is refused, or no connection of the subscriber is left
// on the broker after Close.
func TestRecoveryConfigLeavesNoConnection(t *testing.T) {
	requireRabbitmqctl(t)
	f := newFixture(t, 10)
	name := testenv.Name(t, "conn")
	f.cfg.Connection.AmqpConfig = &amqp091.Config{Heartbeat: 10 * time.Second, Locale: "en_US",
		Properties: amqp091.Table{"connection_name": name},
		Recovery:   &amqp091.Recovery{ReconnectionConfig: &amqp091.ReconnectionConfig{MaxRetryCount: 3, RetryInterval: 100 * time.Millisecond}}}
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: 4}, nil)
	if err != nil {
		return // refused
	}
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	if next(msgs, 10*time.Second) == nil {
		t.Fatal("no message within 10s")
	}
	closeConnection(t, name)
	time.Sleep(2 * time.Second) // both have reconnected
	must(t, sub.Close())
	time.Sleep(500 * time.Millisecond)
	out, err := exec.CommandContext(t.Context(), "rabbitmqctl", "-q", "list_connections", "client_properties").Output()
	must(t, err)
	if c := strings.Count(string(out), `"connection_name","`+name+`"`); c > 0 {
		t.Errorf("%d connections of the closed subscriber left on the broker", c)
	}
}
