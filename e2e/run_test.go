package e2e_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
	"github.com/settle-go/settle/sqldb"
)

// hostile is a payload and a reason that would run script if a page
// wrote it as HTML.
const hostile = `<script>window.pwned=1</script>"><img src=x onerror="window.pwned=2">`

// shop is a real run: a pipeline on a broker (RabbitMQ or GoChannel)
// whose handler "charge" fails every order until fixed, parking each into
// the parked store, and an outbox relay that forwards replays back to the
// topic.
type shop[TTx any] struct {
	db     sqldb.Driver[TTx]
	parked *parked.Store[TTx]
	outbox *outbox.Outbox[TTx]
	claims *dedupe.SQLStore[TTx]
	topic  string // the orders' topic, a name of the test's own
	pub    message.Publisher

	fixed atomic.Bool
	mu    sync.Mutex
	// after the fix: deliveries on the topic, and runs of the handler that
	// succeeded, per order
	delivered, charged map[int]int
	chargedUUID        map[int]string // the UUID of the message that charged the order
}

type order struct {
	Order int `json:"order"`
	Cents int `json:"cents"`
}

// Brokers a shop runs on.
const (
	onGoChannel = "gochannel"
	onRabbitMQ  = "rabbitmq"
)

// newShop creates the tables (dropped at the end), runs the pipeline and
// the relay on broker until the test ends.
func newShop[TTx any](t *testing.T, db sqldb.Driver[TTx], broker string) *shop[TTx] {
	t.Helper()
	ctx := t.Context()
	table, topic, dd := uniq("pk"), uniq("ob"), uniq("dd")
	s := &shop[TTx]{db: db, topic: uniq("orders"), delivered: map[int]int{}, charged: map[int]int{}, chargedUUID: map[int]string{}}
	var err error
	if s.parked, err = parked.New(db, parked.Config{Table: table}); err != nil {
		t.Fatal(err)
	}
	if s.outbox, err = outbox.New(db, outbox.Config{Topic: topic}); err != nil {
		t.Fatal(err)
	}
	if s.claims, err = dedupe.NewSQLStore(db, dedupe.SQLConfig{Table: dd}); err != nil {
		t.Fatal(err)
	}
	var ddl []string
	ddl = append(append(append(ddl, s.parked.Schema()...), s.outbox.Schema()...), s.claims.Schema()...)
	for _, q := range ddl {
		if _, err := db.DB().Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		for _, name := range []string{table, table + "_groups", topic, topic + "_relays", dd} {
			_, _ = db.DB().Exec(context.Background(), `DROP TABLE IF EXISTS "`+name+`"`)
		}
	})

	pub, sub, counter := s.broker(t, broker)
	s.pub = pub
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: pub, Store: s.claims, DisableTracing: true, ParkStore: s.parked,
		Retry:     middleware.RetryConfig{MaxAttempts: 2, NoInProcessRetries: true, RedeliveryDelay: settle.NoDelay},
		BusyDelay: 10 * time.Millisecond, NackDelay: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Handle("charge", s.topic, sub, func(m *message.Message) error {
		var o order
		if err := json.Unmarshal(m.Payload, &o); err != nil {
			return poison.Permanent(fmt.Errorf("cannot read the order %s", m.Payload))
		}
		if !s.fixed.Load() {
			return fmt.Errorf("card declined for order %d", o.Order)
		}
		s.mu.Lock()
		s.charged[o.Order]++
		s.chargedUUID[o.Order] = m.UUID
		s.mu.Unlock()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Every delivery on the topic, handled or not, counted after the fix.
	raw, err := counter.Subscribe(ctx, s.topic)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := s.outbox.NewRelay(pub, outbox.RelayConfig{PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = router.Run(rctx) })
	wg.Go(func() { _ = relay.Run(rctx) })
	wg.Go(func() {
		for m := range raw {
			var o order
			if s.fixed.Load() && json.Unmarshal(m.Payload, &o) == nil {
				s.mu.Lock()
				s.delivered[o.Order]++
				s.mu.Unlock()
			}
			m.Ack()
		}
	})
	t.Cleanup(func() {
		stop()
		_ = relay.Close()
		_ = router.Close()
		_ = sub.Close()
		_ = counter.Close()
		_ = pub.Close()
		wg.Wait()
	})
	<-router.Running()
	return s
}

// publish publishes orders 1..n and one hostile message, and waits until
// every one is parked.
func (s *shop[TTx]) publish(t *testing.T, n int) {
	t.Helper()
	for i := 1; i <= n; i++ {
		b, _ := json.Marshal(order{Order: i, Cents: 1000 + i})
		m := message.NewMessage(watermill.NewUUID(), b)
		m.Metadata.Set("content_type", "application/json")
		m.Metadata.Set("tenant", "acme")
		m.Metadata.Set("traceparent", fmt.Sprintf("00-4bf92f3577b34da6a3ce929d0e0e47%02x-00f067aa0ba902%02x-01", i, i))
		if err := s.pub.Publish(s.topic, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.pub.Publish(s.topic, message.NewMessage(watermill.NewUUID(), []byte(hostile))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, fmt.Sprintf("%d parked rows", n+1), func() bool {
		c, err := s.parked.Count(t.Context(), parked.Filter{State: parked.StateParked})
		return err == nil && c == int64(n+1)
	})
}

// broker returns the shop's publisher, the subscriber of the handler and
// a second subscriber that sees every message on the topic too, on broker.
// On RabbitMQ the topic is a fanout exchange with a durable queue for each
// subscriber (deleted at the end), the publisher settle's amqpsub, which
// reports a message no queue took.
func (s *shop[TTx]) broker(t *testing.T, broker string) (pub message.Publisher, sub, counter message.Subscriber) {
	t.Helper()
	switch broker {
	case onGoChannel:
		g := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100}, watermill.NopLogger{})
		return g, g, g
	case onRabbitMQ:
	default:
		t.Fatalf("broker %q", broker)
	}
	url := testenv.AMQPURL(t)
	config := func(suffix string) amqp.Config {
		return amqp.NewDurablePubSubConfig(url, amqp.GenerateQueueNameTopicNameWithSuffix(suffix))
	}
	p, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: config("charge")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: config("charge"), InFlight: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := amqp.NewSubscriber(config("count"), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := amqp091.Dial(url)
		if err != nil {
			t.Errorf("cleaning up the queues: %v", err)
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("cleaning up the queues: %v", err)
			return
		}
		for _, q := range []string{s.topic + "_charge", s.topic + "_count"} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.ExchangeDelete(s.topic, false, false)
	})
	return p, h, c
}

// counts returns copies of the counters.
func (s *shop[TTx]) counts() (delivered, charged map[int]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delivered, charged = map[int]int{}, map[int]int{}
	for k, v := range s.delivered {
		delivered[k] = v
	}
	for k, v := range s.charged {
		charged[k] = v
	}
	return delivered, charged
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 20s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// uniq returns prefix and random hex: a table name of the test's own.
func uniq(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_e2e_" + hex.EncodeToString(b[:])
}
