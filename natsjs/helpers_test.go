package natsjs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/natsjs"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// env is one test's JetStream stream: its name is also its topic, and it
// takes the topic and every subject below it (topic.dead_letter, ...).
type env struct {
	url   string
	topic string
	js    nats.JetStreamContext
}

// setup creates a stream of the test's own, deleted when the test ends.
func setup(t *testing.T) env {
	t.Helper()
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.Name(t, "natsjs")
	if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name, name + ".>"}, Storage: nats.MemoryStorage}); err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(name) })
	return env{url: url, topic: name, js: js}
}

// publisher is natsjs.NewPublisher's.
func (e env) publisher(t *testing.T) message.Publisher {
	t.Helper()
	pub, err := natsjs.NewPublisher(natsjs.NewPublisherConfig(e.url), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func (e env) publish(t *testing.T, msgs ...*message.Message) {
	t.Helper()
	if err := e.publisher(t).Publish(e.topic, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

func (e env) subscriber(t *testing.T, cfg natsjs.Config) *natsjs.Subscriber {
	t.Helper()
	if cfg.Durable == "" {
		cfg.Durable = "d"
	}
	sub, err := natsjs.NewSubscriber(e.url, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// consumerInfo is the durable consumer d of the test's topic.
func (e env) consumerInfo(t *testing.T, durable string) *nats.ConsumerInfo {
	t.Helper()
	ci, err := e.js.ConsumerInfo(e.topic, durable+"_"+e.topic)
	if err != nil {
		t.Fatalf("consumer info: %v", err)
	}
	return ci
}

// waitSettled waits until the consumer durable has nothing pending and
// nothing unacked.
func (e env) waitSettled(t *testing.T, durable string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ci := e.consumerInfo(t, durable)
		if ci.NumPending == 0 && ci.NumAckPending == 0 && ci.NumRedelivered == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("consumer %s not settled after %v: %d pending, %d unacked, %d redelivered", durable, within, ci.NumPending, ci.NumAckPending, ci.NumRedelivered)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// streamCount is how many messages the stream holds on subject.
func (e env) streamCount(t *testing.T, subject string) int {
	t.Helper()
	si, err := e.js.StreamInfo(e.topic, &nats.StreamInfoRequest{SubjectsFilter: subject})
	if err != nil {
		t.Fatal(err)
	}
	return int(si.State.Subjects[subject])
}

// next receives the next message of ch, failing the test after within.
func next(t *testing.T, ch <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		if !ok {
			t.Fatal("subscription closed")
		}
		return m
	case <-time.After(within):
		t.Fatalf("no message within %v", within)
	}
	return nil
}

func subscribe(t *testing.T, sub message.Subscriber, topic string) <-chan *message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatalf("subscribe: %v", err)
	}
	return ch
}
