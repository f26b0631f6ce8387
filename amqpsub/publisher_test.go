package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
)

// pubFixture is a broker connection of the test's own and the queues and
// exchanges it declared, deleted when the test ends.
type pubFixture struct {
	url  string
	conn *amqp091.Connection
}

func newPubFixture(t *testing.T) *pubFixture {
	t.Helper()
	f := &pubFixture{url: testenv.AMQPURL(t)}
	var err error
	f.conn, err = amqp091.Dial(f.url)
	must(t, err)
	t.Cleanup(func() { _ = f.conn.Close() })
	return f
}

// queue declares a durable queue, deleted when the test ends.
func (f *pubFixture) queue(t *testing.T, name string) {
	t.Helper()
	ch, err := f.conn.Channel()
	must(t, err)
	defer ch.Close()
	_, err = ch.QueueDeclare(name, true, false, false, false, nil)
	must(t, err)
	f.cleanup(t, func(ch *amqp091.Channel) { _, _ = ch.QueueDelete(name, false, false, false) })
}

// exchange declares a fanout exchange, deleted when the test ends; bind
// names the queues bound to it.
func (f *pubFixture) exchange(t *testing.T, name string, bind ...string) {
	t.Helper()
	ch, err := f.conn.Channel()
	must(t, err)
	defer ch.Close()
	must(t, ch.ExchangeDeclare(name, "fanout", false, false, false, false, nil))
	for _, q := range bind {
		must(t, ch.QueueBind(q, "", name, false, nil))
	}
	f.cleanup(t, func(ch *amqp091.Channel) { _ = ch.ExchangeDelete(name, false, false) })
}

func (f *pubFixture) cleanup(t *testing.T, do func(*amqp091.Channel)) {
	t.Cleanup(func() {
		// On a connection of its own: the fixture's may be closed by then.
		c, err := amqp091.Dial(f.url)
		if err != nil {
			return
		}
		defer c.Close()
		if ch, err := c.Channel(); err == nil {
			do(ch)
		}
	})
}

// drain takes every message of queue off it and returns their UUIDs (the
// message_id amqpmarshal writes), each with how many times it was there.
func (f *pubFixture) drain(t *testing.T, queue string) map[string]int {
	t.Helper()
	ch, err := f.conn.Channel()
	must(t, err)
	defer ch.Close()
	got := map[string]int{}
	for {
		d, ok, err := ch.Get(queue, true)
		must(t, err)
		if !ok {
			return got
		}
		got[d.MessageId]++
	}
}

// config is a watermill-amqp configuration in which a topic "ex:NAME" is
// published to the exchange NAME with an empty routing key, and any other
// topic to the default exchange with the topic as routing key (the queue of
// that name, as NewDurableQueueConfig does).
func (f *pubFixture) config(t *testing.T) amqp.Config {
	t.Helper()
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	must(t, err)
	cfg := amqp.NewDurableQueueConfig(f.url)
	cfg.Marshaler = m
	cfg.Exchange.GenerateName = func(topic string) string {
		name, _ := strings.CutPrefix(topic, "ex:")
		if name == topic {
			return ""
		}
		return name
	}
	cfg.Exchange.Type = "fanout"
	cfg.Publish.GenerateRoutingKey = func(topic string) string {
		if strings.HasPrefix(topic, "ex:") {
			return ""
		}
		return topic
	}
	return cfg
}

func (f *pubFixture) publisher(t *testing.T, cfg amqp.Config) *amqpsub.Publisher {
	t.Helper()
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, nil)
	must(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// Publish returns nil only for a message the broker routed to a queue, and
// an error wrapping ErrUnroutable, naming the exchange and the routing key,
// for one it routed nowhere (RabbitMQ confirms those too): 100 goroutines at
// once, each with one message to a queue, to an exchange bound to a queue,
// to the default exchange with no queue of that name, or to an exchange with
// no binding. Each result is checked, and the queues hold exactly the
// messages that Publish said were routed.
func TestPublishReportsUnroutableMessages(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	q1, q2 := testenv.Name(t, "q1"), testenv.Name(t, "q2")
	bound, unbound := testenv.Name(t, "xb"), testenv.Name(t, "xu")
	f.queue(t, q1)
	f.queue(t, q2)
	f.exchange(t, bound, q2)
	f.exchange(t, unbound)
	pub := f.publisher(t, f.config(t))

	type target struct {
		topic, exchange, key string
		queue                string // "" when nothing is bound
	}
	targets := []target{
		{topic: q1, key: q1, queue: q1},
		{topic: "ex:" + bound, exchange: bound, queue: q2},
		{topic: q1 + "_missing", key: q1 + "_missing"},
		{topic: "ex:" + unbound, exchange: unbound},
	}
	const n = 100
	errs := make([]error, n)
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start.Wait()
			errs[i] = pub.Publish(targets[i%len(targets)].topic, message.NewMessage(fmt.Sprintf("m%03d", i), []byte(`{}`)))
		}()
	}
	start.Done()
	wg.Wait()

	want := map[string]map[string]int{q1: {}, q2: {}}
	for i, err := range errs {
		tg := targets[i%len(targets)]
		id := fmt.Sprintf("m%03d", i)
		switch {
		case tg.queue != "":
			if err != nil {
				t.Errorf("%s to %q (routed to %s): %v", id, tg.topic, tg.queue, err)
			}
			want[tg.queue][id] = 1
		case err == nil:
			t.Errorf("%s to %q (routed nowhere): Publish returned nil", id, tg.topic)
		case !errors.Is(err, amqpsub.ErrUnroutable):
			t.Errorf("%s to %q (routed nowhere): %v, want ErrUnroutable", id, tg.topic, err)
		case !strings.Contains(err.Error(), fmt.Sprintf("exchange %q, routing key %q", tg.exchange, tg.key)):
			t.Errorf("%s to %q: %q names neither exchange %q nor routing key %q", id, tg.topic, err, tg.exchange, tg.key)
		}
	}
	for q, ids := range want {
		got := f.drain(t, q)
		if fmt.Sprint(got) != fmt.Sprint(ids) {
			t.Errorf("queue %s holds %v, want %v", q, got, ids)
		}
	}
}

// A publisher that does not listen for returns, as watermill-amqp's, even
// with Mandatory and ConfirmDelivery, reports a message routed to no queue
// as published: what docs/poison.md says and the publisher above is for. If
// this test fails, watermill-amqp has learnt to report returns and the docs
// and the parking middleware's warning are to be changed.
func TestWatermillAMQPPublisherReportsUnroutableAsPublished(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	cfg := f.config(t)
	cfg.Publish.ConfirmDelivery = true
	cfg.Publish.Mandatory = true
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	defer pub.Close()
	if err := pub.Publish(testenv.Name(t, "missing"), message.NewMessage("m1", []byte(`{}`))); err != nil {
		t.Fatalf("watermill-amqp returned %v for a message routed nowhere: it detects returns now", err)
	}
}

// Bad configurations are refused with the field named; Close twice is nil;
// Publish and SubscribeInitialize after Close are errors; a publisher whose
// configuration declares no queue cannot SubscribeInitialize.
func TestPublisherMisuse(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	for name, edit := range map[string]func(*amqp.Config){
		"ChannelPoolSize": func(c *amqp.Config) { c.Publish.ChannelPoolSize = -1 },
		"Transactional":   func(c *amqp.Config) { c.Publish.Transactional = true },
		"Immediate":       func(c *amqp.Config) { c.Publish.Immediate = true },
		"Recovery": func(c *amqp.Config) {
			c.Connection.AmqpConfig = &amqp091.Config{Recovery: &amqp091.Recovery{}}
		},
		"Marshaler": func(c *amqp.Config) { c.Marshaler = nil },
	} {
		cfg := f.config(t)
		edit(&cfg)
		if _, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, nil); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: error %v does not name it", name, err)
		}
	}

	cfg := f.config(t)
	cfg.Queue.GenerateName = nil
	pub := f.publisher(t, cfg)
	if err := pub.SubscribeInitialize("x"); err == nil || !strings.Contains(err.Error(), "Queue.GenerateName") {
		t.Errorf("SubscribeInitialize without Queue.GenerateName: %v", err)
	}
	must(t, pub.Close())
	must(t, pub.Close())
	if err := pub.Publish("x", message.NewMessage("m1", nil)); err == nil {
		t.Error("Publish after Close: no error")
	}
	if err := pub.SubscribeInitialize("x"); err == nil {
		t.Error("SubscribeInitialize after Close: no error")
	}
}

// SubscribeInitialize declares what a subscriber of the same configuration
// would: a message published after it is routed.
func TestPublisherSubscribeInitialize(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	q := testenv.Name(t, "q")
	f.cleanup(t, func(ch *amqp091.Channel) { _, _ = ch.QueueDelete(q, false, false, false) })
	pub := f.publisher(t, f.config(t))
	if err := pub.Publish(q, message.NewMessage("m1", nil)); !errors.Is(err, amqpsub.ErrUnroutable) {
		t.Fatalf("before SubscribeInitialize: %v, want ErrUnroutable", err)
	}
	must(t, pub.SubscribeInitialize(q))
	must(t, pub.Publish(q, message.NewMessage("m2", nil)))
	if got := f.drain(t, q); fmt.Sprint(got) != "map[m2:1]" {
		t.Errorf("queue holds %v, want m2", got)
	}
}

// A connection the broker closes while messages are being published gives
// errors (ErrNotConfirmed), never a nil for a message that is not on the
// queue, and publishing goes on once the publisher has reconnected. Eight
// goroutines publish all the time; the broker closes the publisher's
// connection once. Every message for which Publish returned nil is on the
// queue afterwards.
func TestPublishThroughAClosedConnection(t *testing.T) {
	requireRabbitmqctl(t)
	f := newPubFixture(t)
	q := testenv.Name(t, "q")
	f.queue(t, q)
	cfg := f.config(t)
	name := testenv.Name(t, "conn")
	cfg.Connection.AmqpConfig = &amqp091.Config{Heartbeat: 10 * time.Second, Locale: "en_US",
		Properties: amqp091.Table{"connection_name": name}}
	cfg.Connection.Reconnect = &amqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 2, BackoffMaxInterval: time.Second}
	pub := f.publisher(t, cfg)

	var (
		mu          sync.Mutex
		ok          = map[string]bool{}
		unconfirmed int
		otherErrs   []string
		closed      atomic.Bool
		okAfter     atomic.Int64 // nil results of publishes started after the close
		stop        = make(chan struct{})
		wg          sync.WaitGroup
	)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				after := closed.Load()
				id := fmt.Sprintf("g%d-%05d", g, i)
				err := pub.Publish(q, message.NewMessage(id, []byte(`{}`)))
				mu.Lock()
				switch {
				case err == nil:
					ok[id] = true
					if after {
						okAfter.Add(1)
					}
				case errors.Is(err, amqpsub.ErrNotConfirmed):
					unconfirmed++
				default:
					otherErrs = append(otherErrs, err.Error())
				}
				mu.Unlock()
				if err != nil {
					time.Sleep(10 * time.Millisecond)
				} else {
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	time.Sleep(500 * time.Millisecond)
	closeConnection(t, name)
	closed.Store(true)
	deadline := time.Now().Add(30 * time.Second)
	for okAfter.Load() < 50 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()

	got := f.drain(t, q)
	lost := 0
	for id := range ok {
		if got[id] == 0 {
			lost++
			if lost <= 5 {
				t.Errorf("%s: Publish returned nil, and it is not on the queue", id)
			}
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d messages reported published are not on the queue", lost, len(ok))
	}
	if unconfirmed == 0 {
		t.Errorf("no publish failed with ErrNotConfirmed when the connection was closed (other errors: %q)", otherErrs[:min(3, len(otherErrs))])
	}
	if okAfter.Load() < 50 {
		t.Errorf("%d messages published after the connection was closed, want 50 within 30s", okAfter.Load())
	}
	t.Logf("%d published, %d unconfirmed, %d other errors (e.g. %q), %d on the queue", len(ok), unconfirmed, len(otherErrs), otherErrs[:min(1, len(otherErrs))], len(got))
}

// The messages of one Publish call are all published. A message whose
// context is done is not published, and the publisher goes on.
func TestPublishSeveralAndCancelled(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	q := testenv.Name(t, "q")
	f.queue(t, q)
	pub := f.publisher(t, f.config(t))
	must(t, pub.Publish(q, message.NewMessage("m1", nil), message.NewMessage("m2", nil)))

	cancelled := message.NewMessage("m3", nil)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	cancelled.SetContext(ctx)
	if err := pub.Publish(q, cancelled); !errors.Is(err, context.Canceled) {
		t.Errorf("a message whose context is done: %v, want context.Canceled", err)
	}
	must(t, pub.Publish(q, message.NewMessage("m4", nil)))
	if got := f.drain(t, q); fmt.Sprint(got) != "map[m1:1 m2:1 m4:1]" {
		t.Errorf("queue holds %v, want m1, m2 and m4", got)
	}
}
