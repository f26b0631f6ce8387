package integration_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// dedupeWait bounds every wait for a condition in these tests.
const dedupeWait = 20 * time.Second

// dedupeAMQP is one test's RabbitMQ queue, PostgreSQL effects table and a
// router consuming the queue.
type dedupeAMQP struct {
	t          *testing.T
	url        string
	db         testenv.DB
	queue      string
	effects    string // business table: one row per effect
	pub        *amqp.Publisher
	stopRouter func() // set once the router runs

	mu         sync.Mutex
	deliveries []error // what each delivery returned: nil is ack, an error nack
}

func newDedupeAMQP(t *testing.T) *dedupeAMQP {
	t.Helper()
	e := &dedupeAMQP{
		t:     t,
		url:   testenv.AMQPURL(t),
		db:    testenv.Postgres(t),
		queue: testenv.Name(t, "q"),
	}
	e.effects = testenv.Name(t, "fx")
	if _, err := e.db.ExecContext(t.Context(), `CREATE TABLE "`+e.effects+`" (message_uuid text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+e.effects+`"`)
	})
	t.Cleanup(func() {
		conn, err := amqp091.Dial(e.url)
		if err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
			return
		}
		defer ch.Close()
		if _, err := ch.QueueDelete(e.queue, false, false, false); err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
		}
	})
	return e
}

// start runs a router consuming the queue with the given middleware inside
// an outer recorder, and a publisher to the queue.
func (e *dedupeAMQP) start(h message.NoPublishHandlerFunc, mw message.HandlerMiddleware) {
	t := e.t
	t.Helper()
	cfg := amqp.NewDurableQueueConfig(e.url)
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
	})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: dedupeWait}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(e.record, mw)
	r.AddConsumerHandler("dedupe_amqp", e.queue, sub, h)
	e.stopRouter = runRouter(t, r, dedupeWait)
}

// stop closes the router and waits for Run to return. It may be called
// twice.
func (e *dedupeAMQP) stop() {
	if e.stopRouter != nil {
		e.stopRouter()
	}
}

func (e *dedupeAMQP) record(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		e.mu.Lock()
		e.deliveries = append(e.deliveries, err)
		e.mu.Unlock()
		return out, err
	}
}

func (e *dedupeAMQP) recorded() []error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]error(nil), e.deliveries...)
}

func (e *dedupeAMQP) publish(uuid string) {
	e.t.Helper()
	if err := e.pub.Publish(e.queue, message.NewMessage(uuid, []byte(`{"order":1}`))); err != nil {
		e.t.Fatalf("publish: %v", err)
	}
}

// effect records one effect of msg in the business table.
func (e *dedupeAMQP) effect(msg *message.Message) error {
	_, err := e.db.ExecContext(msg.Context(), `INSERT INTO "`+e.effects+`" (message_uuid) VALUES ($1)`, msg.UUID)
	return err
}

func (e *dedupeAMQP) countEffects() int {
	e.t.Helper()
	var n int
	if err := e.db.QueryRowContext(e.t.Context(), `SELECT COUNT(*) FROM "`+e.effects+`"`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// waitDeliveries polls until n deliveries were handled.
func (e *dedupeAMQP) waitDeliveries(n int) []error {
	e.t.Helper()
	deadline := time.Now().Add(dedupeWait)
	for {
		got := e.recorded()
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d deliveries handled within %v, want %d", len(got), dedupeWait, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stopAndExpectEmptyQueue closes the router, so that any message it held
// unacked goes back to the queue, then polls the queue until it has no
// consumer and checks that no message is left in it: every delivery was
// acked.
func (e *dedupeAMQP) stopAndExpectEmptyQueue() {
	t := e.t
	t.Helper()
	e.stop()
	conn, err := amqp091.Dial(e.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	deadline := time.Now().Add(dedupeWait)
	for {
		q, err := ch.QueueDeclarePassive(e.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatalf("inspect queue %s: %v", e.queue, err)
		}
		if q.Consumers == 0 {
			if q.Messages != 0 {
				t.Errorf("queue %s holds %d messages after the router closed, want 0", e.queue, q.Messages)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s still has %d consumers after the router closed", e.queue, q.Consumers)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (e *dedupeAMQP) dedupeMiddleware() message.HandlerMiddleware {
	e.t.Helper()
	table := testenv.DedupeTable(e.t, e.db)
	store, err := dedupe.NewSQLStore(e.db.Driver(), dedupe.SQLConfig{Table: table})
	if err != nil {
		e.t.Fatal(err)
	}
	mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
	if err != nil {
		e.t.Fatal(err)
	}
	return mw
}

var errDedupeFirstDelivery = errors.New("first delivery fails")

func TestDedupeAMQPSameMessageTwiceHasOneEffect(t *testing.T) {
	t.Parallel()
	e := newDedupeAMQP(t)
	var calls atomic.Int32
	e.start(func(msg *message.Message) error {
		calls.Add(1)
		return e.effect(msg)
	}, e.dedupeMiddleware())

	uuid := watermill.NewUUID()
	e.publish(uuid)
	e.publish(uuid)

	got := e.waitDeliveries(2)
	if fmt.Sprint(got) != fmt.Sprint([]error{nil, nil}) {
		t.Errorf("deliveries = %v, want both acked", got)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1", n)
	}
	if n := e.countEffects(); n != 1 {
		t.Errorf("effects = %d, want 1", n)
	}
	e.stopAndExpectEmptyQueue()
	if got := e.recorded(); len(got) != 2 {
		t.Errorf("%d deliveries in all, want 2", len(got))
	}
}

func TestDedupeAMQPFailedFirstDeliveryHasOneEffect(t *testing.T) {
	t.Parallel()
	e := newDedupeAMQP(t)
	var calls atomic.Int32
	e.start(func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			return errDedupeFirstDelivery
		}
		return e.effect(msg)
	}, e.dedupeMiddleware())

	e.publish(watermill.NewUUID())

	got := e.waitDeliveries(2)
	if len(got) != 2 || !errors.Is(got[0], errDedupeFirstDelivery) || got[1] != nil {
		t.Errorf("deliveries = %v, want [nack, ack]", got)
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("handler calls = %d, want 2", n)
	}
	if n := e.countEffects(); n != 1 {
		t.Errorf("effects = %d, want 1", n)
	}
	e.stopAndExpectEmptyQueue()
	if got := e.recorded(); len(got) != 2 {
		t.Errorf("%d deliveries in all, want 2", len(got))
	}
}

// TestDedupeAMQPWatermillDeduplicatorLosesFailedMessage shows, on RabbitMQ,
// the loss settle's dedupe exists to prevent: Watermill's Deduplicator
// (v1.5.1) records the key before the handler runs, so the redelivery of a
// failed message is acked as a duplicate and the work never happens. The
// test asserts the loss; if it fails, Watermill has changed this behaviour
// and the docs that cite it must be revised.
func TestDedupeAMQPWatermillDeduplicatorLosesFailedMessage(t *testing.T) {
	t.Parallel()
	e := newDedupeAMQP(t)
	var calls atomic.Int32
	dedup := &middleware.Deduplicator{
		KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
	}
	e.start(func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			return errDedupeFirstDelivery
		}
		return e.effect(msg)
	}, dedup.Middleware)

	e.publish(watermill.NewUUID())

	got := e.waitDeliveries(2)
	if len(got) != 2 || !errors.Is(got[0], errDedupeFirstDelivery) || got[1] != nil {
		t.Errorf("deliveries = %v, want [nack, ack without running]", got)
	}
	e.stopAndExpectEmptyQueue()
	if n := calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1 (the redelivery is dropped)", n)
	}
	if n := e.countEffects(); n != 0 {
		t.Errorf("effects = %d, want 0 (the work is lost)", n)
	}
}
