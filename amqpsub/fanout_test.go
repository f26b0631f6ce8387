package amqpsub_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
)

// counter counts handler calls and final acks per message.
type counter struct {
	mu    sync.Mutex
	calls map[string]int
	done  map[string]int
}

func newCounter() *counter { return &counter{calls: map[string]int{}, done: map[string]int{}} }

func (c *counter) call(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls[id]++
	return c.calls[id]
}

func (c *counter) finish(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done[id]++
}

func (c *counter) finished() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.done)
}

// Fan-out as watermill-amqp documents it: two subscribers whose pub/sub
// configurations differ only in the queue-name suffix, one router, two
// handlers on one topic (one under Retry with errors, one nacking every
// third message once). Each handler must get every message, and both queues
// are empty at the end.
func TestFanOutTwoHandlersEachGetEveryMessage(t *testing.T) {
	t.Parallel()
	const n = 60
	url := testenv.AMQPURL(t)
	topic := testenv.Name(t, "topic")
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	must(t, err)
	cfg := func(suffix string) amqp.Config {
		c := amqp.NewDurablePubSubConfig(url, amqp.GenerateQueueNameTopicNameWithSuffix(suffix))
		c.Marshaler = m
		return c
	}
	admin, err := amqp091.Dial(url)
	must(t, err)
	t.Cleanup(func() {
		if ch, err := admin.Channel(); err == nil {
			for _, q := range []string{topic + "_a", topic + "_b"} {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			_ = ch.ExchangeDelete(topic, false, false)
		}
		_ = admin.Close()
	})
	subA, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg("a"), InFlight: 8}, nil)
	must(t, err)
	t.Cleanup(func() { _ = subA.Close() })
	subB, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg("b"), InFlight: 4}, nil)
	must(t, err)
	t.Cleanup(func() { _ = subB.Close() })

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	router.AddMiddleware(middleware.Recoverer)
	a, b := newCounter(), newCounter()
	router.AddConsumerHandler("a", topic, subA, func(msg *message.Message) error {
		id, _ := strconv.Atoi(msg.UUID[1:])
		if a.call(msg.UUID) == 1 && id%3 == 0 {
			msg.Nack()
			return nil
		}
		time.Sleep(time.Duration(id%4) * time.Millisecond)
		a.finish(msg.UUID)
		return nil
	})
	hb := router.AddConsumerHandler("b", topic, subB, func(msg *message.Message) error {
		id, _ := strconv.Atoi(msg.UUID[1:])
		if b.call(msg.UUID) <= 2 && id%5 == 0 {
			return errors.New("transient")
		}
		if id == 7 {
			panic("once") // Recoverer turns it into an error; Retry retries
		}
		b.finish(msg.UUID)
		return nil
	})
	hb.AddMiddleware(middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- router.Run(ctx) }()
	<-router.Running()

	ch, err := admin.Channel()
	must(t, err)
	for i := range n {
		must(t, ch.PublishWithContext(t.Context(), topic, "", false, false, amqp091.Publishing{
			MessageId: "m" + strconv.Itoa(i), DeliveryMode: amqp091.Persistent, Body: []byte(`{}`),
		}))
	}
	deadline := time.Now().Add(20 * time.Second)
	for (a.finished() < n || b.finished() < n-1) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	must(t, router.Close())
	must(t, <-errc)
	if got := a.finished(); got != n {
		t.Errorf("handler a finished %d of %d messages", got, n)
	}
	if got := b.finished(); got != n-1 { // m7 panics every time
		t.Errorf("handler b finished %d of %d messages", got, n-1)
	}
	for id, c := range a.done {
		if c != 1 {
			t.Errorf("a: %s finished %d times", id, c)
		}
	}
	for id, c := range b.done {
		if c != 1 {
			t.Errorf("b: %s finished %d times", id, c)
		}
	}
	// m7 keeps failing in b and is nacked (requeued) after Retry gives up.
	for _, q := range []struct {
		name string
		want int
	}{{topic + "_a", 0}, {topic + "_b", 1}} {
		qq, err := ch.QueueDeclarePassive(q.name, true, false, false, false, nil)
		must(t, err)
		if qq.Messages != q.want {
			t.Errorf("%s: %d messages left, want %d", q.name, qq.Messages, q.want)
		}
	}
}
