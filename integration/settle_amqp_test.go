package integration_test

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// saWait bounds every wait for a condition in the settle-on-RabbitMQ tests.
const saWait = 30 * time.Second

const saHandler = "charge_order"

var (
	errSAFlaky      = errors.New("payment provider timed out")
	errSABadOrder   = errors.New("order has no customer")
	errSADeadLetter = errors.New("dead-letter broker unavailable (injected)")
)

// saOpts configures one settle stack on RabbitMQ.
type saOpts struct {
	retry middleware.RetryConfig
	// noDedupe leaves the dedupe middleware out; attempts are then counted
	// from the broker (quorum queues) or in memory.
	noDedupe bool
	// quorum declares the source queue as a quorum queue.
	quorum bool
	// failDeadLetters makes the first n publishes to the dead-letter topic
	// fail.
	failDeadLetters int64
	// republish hands failed messages back with retry.Republish (the
	// test's publisher) instead of nacking them.
	republish bool
}

// saRepublishKey signs the republished copies of the tests that set
// saOpts.republish.
var saRepublishKey = []byte("integration test republish key")

// saFastRetry is a retry configuration with millisecond waits.
func saFastRetry(maxAttempts, inProcess int) middleware.RetryConfig {
	cfg := middleware.RetryConfig{
		MaxAttempts:     maxAttempts,
		InitialInterval: time.Millisecond,
		MaxInterval:     5 * time.Millisecond,
		RedeliveryDelay: 5 * time.Millisecond,
	}
	if inProcess == 0 {
		cfg.NoInProcessRetries = true
	} else {
		cfg.InProcessRetries = inProcess
	}
	return cfg
}

// saEnv is one test's settle stack on RabbitMQ: a router consuming a source
// queue through observe -> poison -> dead-letter -> retry -> dedupe (the
// PostgreSQL store) -> handler, whose dead-letter and poison topics are
// RabbitMQ queues too.
type saEnv struct {
	t                 *testing.T
	url               string
	opts              saOpts
	src, dead, poison string
	ch                *amqp091.Channel // raw channel: declare, inspect, get, delete
	marshaler         amqpmarshal.Marshaler
	pub               *amqp.Publisher
	stopRouter        func() // set once the router runs

	calls     atomic.Int64 // handler calls
	deadTries atomic.Int64 // publishes to the dead-letter topic, failed ones included

	mu       sync.Mutex
	settled  []error            // what each delivery returned: nil is ack, an error nack
	metadata []message.Metadata // what the handler saw, per call
}

func newSAEnv(t *testing.T, opts saOpts, handler func(call int64, msg *message.Message) error) *saEnv {
	t.Helper()
	e := &saEnv{
		t:      t,
		url:    testenv.AMQPURL(t),
		opts:   opts,
		src:    testenv.Name(t, "src"),
		dead:   testenv.Name(t, "dead"),
		poison: testenv.Name(t, "poison"),
	}
	m, err := amqpmarshal.New(amqpmarshal.Config{QuorumQueue: opts.quorum})
	if err != nil {
		t.Fatal(err)
	}
	e.marshaler = m

	conn, err := amqp091.Dial(e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	e.ch, err = conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the router starts, so it runs after the router has
	// stopped.
	t.Cleanup(func() {
		for _, q := range []string{e.src, e.dead, e.poison} {
			if _, err := e.ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("delete queue %s: %v", q, err)
			}
		}
	})
	// The publisher routes by queue name through the default exchange and
	// declares nothing: every queue must exist before anything is published.
	for _, q := range []string{e.src, e.dead, e.poison} {
		args := amqp091.Table(nil)
		if q == e.src {
			args = e.srcArgs()
		}
		if _, err := e.ch.QueueDeclare(q, true, false, false, false, args); err != nil {
			t.Fatalf("declare queue %s: %v", q, err)
		}
	}
	e.start(handler)
	return e
}

func (e *saEnv) srcArgs() amqp091.Table {
	if e.opts.quorum {
		return amqp091.Table{"x-queue-type": "quorum"}
	}
	return nil
}

func (e *saEnv) amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(e.url)
	cfg.Marshaler = e.marshaler
	cfg.Queue.Arguments = e.srcArgs()
	cfg.Publish.ConfirmDelivery = true
	return cfg
}

func (e *saEnv) start(handler func(call int64, msg *message.Message) error) {
	t := e.t
	t.Helper()
	logger := watermill.NopLogger{}
	pub, err := amqp.NewPublisher(e.amqpConfig(), testenv.AMQPLogger(t, logger))
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	sub, err := amqp.NewSubscriber(e.amqpConfig(), testenv.AMQPLogger(t, logger))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
	})

	var deadPub message.Publisher = &saFailingPublisher{Publisher: pub, fail: e.opts.failDeadLetters, tries: &e.deadTries}
	ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: pub, Initializer: declaredByTest{}, Topic: e.poison, NackDelay: 5 * time.Millisecond, Logger: logger})
	saMust(t, err)
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: deadPub, Topic: e.dead, NackDelay: 5 * time.Millisecond, Logger: logger})
	saMust(t, err)
	if e.opts.republish {
		e.opts.retry.Republish, e.opts.retry.RepublishKey = pub, saRepublishKey
	}
	e.opts.retry.StoreCounts = !e.opts.noDedupe // the dedupe middleware inside counts the runs
	rt, err := middleware.NewRetry(e.opts.retry)
	saMust(t, err)
	mws := []message.HandlerMiddleware{e.observe, ps, dl, rt}
	if !e.opts.noDedupe {
		db := testenv.Postgres(t)
		store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
		saMust(t, err)
		dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, BusyDelay: 5 * time.Millisecond, Logger: logger})
		saMust(t, err)
		mws = append(mws, dd)
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: saWait}, logger)
	saMust(t, err)
	r.AddConsumerHandler(saHandler, e.src, sub, func(msg *message.Message) error {
		n := e.calls.Add(1)
		e.mu.Lock()
		md := make(message.Metadata, len(msg.Metadata))
		for k, v := range msg.Metadata {
			md[k] = v
		}
		e.metadata = append(e.metadata, md)
		e.mu.Unlock()
		return handler(n, msg)
	}).AddMiddleware(mws...)
	e.stopRouter = runRouter(t, r, saWait)
}

// stop closes the router and waits for Run to return. It may be called
// twice.
func (e *saEnv) stop() {
	if e.stopRouter != nil {
		e.stopRouter()
	}
}

// observe is the outermost middleware: it records how each delivery settled.
func (e *saEnv) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		e.mu.Lock()
		e.settled = append(e.settled, err)
		e.mu.Unlock()
		return out, err
	}
}

func (e *saEnv) snapshot() (settled []error, seen []message.Metadata) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]error(nil), e.settled...), append([]message.Metadata(nil), e.metadata...)
}

// publish puts one message on the source queue and returns it.
func (e *saEnv) publish() *message.Message {
	e.t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
	msg.Metadata.Set("order_id", "42")
	if err := e.pub.Publish(e.src, msg); err != nil {
		e.t.Fatalf("publish: %v", err)
	}
	return msg
}

// waitSettled polls until n deliveries have settled and the last was acked.
func (e *saEnv) waitSettled(n int) {
	e.t.Helper()
	deadline := time.Now().Add(saWait)
	for {
		got, _ := e.snapshot()
		if len(got) >= n && got[len(got)-1] == nil {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("deliveries %v within %v, want %d ending in an ack", got, saWait, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// finish stops the router, so that anything it held unacked goes back to the
// queue, checks that the source queue is empty (nothing left, nothing lost),
// and drains the dead-letter and poison queues.
func (e *saEnv) finish() (dead, poisoned []*message.Message) {
	t := e.t
	t.Helper()
	e.stop()
	if n := saQueueAfterConsumersLeft(t, e.ch, e.src, e.srcArgs()); n != 0 {
		t.Errorf("source queue %s holds %d messages after the router closed, want 0", e.src, n)
	}
	return saDrain(t, e.ch, e.marshaler, e.dead), saDrain(t, e.ch, e.marshaler, e.poison)
}

// saQueueAfterConsumersLeft polls the queue until it has no consumer and
// returns the number of messages in it.
func saQueueAfterConsumersLeft(t *testing.T, ch *amqp091.Channel, queue string, args amqp091.Table) int {
	t.Helper()
	deadline := time.Now().Add(saWait)
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, args)
		if err != nil {
			t.Fatalf("inspect queue %s: %v", queue, err)
		}
		if q.Consumers == 0 {
			return q.Messages
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s still has %d consumers", queue, q.Consumers)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// saDrain gets and acks every message in a queue that no one consumes.
func saDrain(t *testing.T, ch *amqp091.Channel, m amqpmarshal.Marshaler, queue string) []*message.Message {
	t.Helper()
	var msgs []*message.Message
	for {
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			t.Fatalf("get from %s: %v", queue, err)
		}
		if !ok {
			return msgs
		}
		msg, err := m.Unmarshal(d)
		if err != nil {
			t.Fatalf("unmarshal from %s: %v", queue, err)
		}
		if err := d.Ack(false); err != nil {
			t.Fatalf("ack on %s: %v", queue, err)
		}
		msgs = append(msgs, msg)
	}
}

// saFailingPublisher fails its first fail publishes and counts all of them.
type saFailingPublisher struct {
	message.Publisher
	fail  int64
	tries *atomic.Int64
}

func (p *saFailingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.tries.Add(1) <= p.fail {
		return errSADeadLetter
	}
	return p.Publisher.Publish(topic, msgs...)
}

// Close does not close the wrapped publisher, which its owner closes.
func (p *saFailingPublisher) Close() error { return nil }

func saMust(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// saCheckParked checks the settle metadata of a dead-letter or poison copy.
func saCheckParked(t *testing.T, e *saEnv, cp, orig *message.Message, outcome settle.Outcome, reason string, attempt int, published time.Time) {
	t.Helper()
	md := cp.Metadata
	want := map[string]string{
		settle.MetaOutcome:       string(outcome),
		settle.MetaReason:        reason,
		settle.MetaOriginalTopic: e.src,
		settle.MetaHandler:       saHandler,
		settle.MetaOriginalUUID:  orig.UUID,
		settle.MetaAttempt:       strconv.Itoa(attempt),
		"order_id":               "42", // the application's own metadata is kept
	}
	for k, v := range want {
		if got := md.Get(k); got != v {
			t.Errorf("parked copy: %s = %q, want %q", k, got, v)
		}
	}
	if cp.UUID != orig.UUID || string(cp.Payload) != string(orig.Payload) {
		t.Errorf("parked copy: UUID %q payload %q, want %q %q", cp.UUID, cp.Payload, orig.UUID, orig.Payload)
	}
	first, err1 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaFirstFailure))
	last, err2 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaLastFailure))
	if err := errors.Join(err1, err2); err != nil {
		t.Fatalf("parked copy: failure times: %v", err)
	}
	now := time.Now()
	if first.Before(published) || last.Before(first) || last.After(now) {
		t.Errorf("parked copy: failure times first %v last %v; want published %v <= first <= last <= now %v",
			first, last, published, now)
	}
	if attempt > 1 && !first.Before(last) {
		t.Errorf("parked copy after %d attempts: first failure %v not before last %v", attempt, first, last)
	}
}

func TestSettleAMQPOutcomes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		opts    saOpts
		handler func(call int64, msg *message.Message) error
		// settled is what each delivery returned, in order: nil (ack), an
		// error it must match with errors.Is, or a pointer to an error type
		// it must match with errors.As.
		settled []any
		// calls is the number of handler calls; attempts is settle_attempt as
		// each call saw it.
		calls    int64
		attempts string
		// deadTries counts publishes to the dead-letter topic, failed ones
		// included; dead and poisoned are the copies on those queues.
		deadTries      int64
		dead, poisoned int
		// check inspects the copies.
		check func(t *testing.T, e *saEnv, orig *message.Message, published time.Time, dead, poisoned []*message.Message)
	}{
		{
			name:     "done",
			opts:     saOpts{retry: saFastRetry(3, 1)},
			handler:  func(int64, *message.Message) error { return nil },
			settled:  []any{nil},
			calls:    1,
			attempts: "[1]",
		},
		{
			// Two failures in the first delivery (one in-process retry), then
			// the broker's redelivery succeeds.
			name: "retry_then_done",
			opts: saOpts{retry: saFastRetry(5, 1)},
			handler: func(call int64, _ *message.Message) error {
				if call <= 2 {
					return errSAFlaky
				}
				return nil
			},
			settled:  []any{errSAFlaky, nil},
			calls:    3,
			attempts: "[1 2 3]",
		},
		{
			// Attempts 1 and 2 in the first delivery, attempt 3 in the
			// redelivery: exhausted, dead-lettered, acked.
			name:      "dead_lettered",
			opts:      saOpts{retry: saFastRetry(3, 1)},
			handler:   func(int64, *message.Message) error { return errSAFlaky },
			settled:   []any{errSAFlaky, nil},
			calls:     3,
			attempts:  "[1 2 3]",
			deadTries: 1,
			dead:      1,
			check: func(t *testing.T, e *saEnv, orig *message.Message, published time.Time, dead, _ []*message.Message) {
				saCheckParked(t, e, dead[0], orig, settle.DeadLettered, errSAFlaky.Error(), 3, published)
			},
		},
		{
			name: "poisoned",
			opts: saOpts{retry: saFastRetry(3, 1)},
			handler: func(int64, *message.Message) error {
				return poison.Permanent(fmt.Errorf("charge: %w", errSABadOrder))
			},
			settled:  []any{nil},
			calls:    1,
			attempts: "[1]",
			poisoned: 1,
			check: func(t *testing.T, e *saEnv, orig *message.Message, published time.Time, _, poisoned []*message.Message) {
				reason := poison.Permanent(fmt.Errorf("charge: %w", errSABadOrder)).Error()
				saCheckParked(t, e, poisoned[0], orig, settle.Poisoned, reason, 1, published)
			},
		},
		{
			// The panic is recovered, the dedupe claim released and the
			// message nacked; the redelivery succeeds at once instead of
			// waiting for the claim to expire.
			name: "panic_then_done",
			opts: saOpts{retry: saFastRetry(3, 0)},
			handler: func(call int64, _ *message.Message) error {
				if call == 1 {
					panic("nil map in charge_order")
				}
				return nil
			},
			settled:  []any{new(*middleware.PanicError), nil},
			calls:    2,
			attempts: "[1 2]",
		},
		{
			// The dead-letter publish fails twice: both times the original is
			// nacked, not acked, and the handler is not run again; the third
			// publish lands and the original is acked.
			name:      "dead_letter_publish_fails_then_lands",
			opts:      saOpts{retry: saFastRetry(2, 0), failDeadLetters: 2},
			handler:   func(int64, *message.Message) error { return errSAFlaky },
			settled:   []any{errSAFlaky, errSADeadLetter, errSADeadLetter, nil},
			calls:     2,
			attempts:  "[1 2]",
			deadTries: 3,
			dead:      1,
			check: func(t *testing.T, e *saEnv, orig *message.Message, published time.Time, dead, _ []*message.Message) {
				saCheckParked(t, e, dead[0], orig, settle.DeadLettered, errSAFlaky.Error(), 2, published)
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			e := newSAEnv(t, tc.opts, tc.handler)
			published := time.Now()
			orig := e.publish()
			e.waitSettled(len(tc.settled))
			dead, poisoned := e.finish()

			settled, seen := e.snapshot()
			if len(settled) != len(tc.settled) {
				t.Fatalf("deliveries = %v, want %d", settled, len(tc.settled))
			}
			for i, want := range tc.settled {
				got := settled[i]
				switch w := want.(type) {
				case nil:
					if got != nil {
						t.Errorf("delivery %d returned %v, want nil (ack)", i+1, got)
					}
				case error:
					if !errors.Is(got, w) {
						t.Errorf("delivery %d returned %v, want %v (nack)", i+1, got, w)
					}
				default:
					if !errors.As(got, w) {
						t.Errorf("delivery %d returned %v, want %T (nack)", i+1, got, w)
					}
				}
			}
			if n := e.calls.Load(); n != tc.calls {
				t.Errorf("handler calls = %d, want %d", n, tc.calls)
			}
			var attempts []string
			for _, md := range seen {
				attempts = append(attempts, md.Get(settle.MetaAttempt))
			}
			if got := fmt.Sprint(attempts); got != tc.attempts {
				t.Errorf("%s per handler call = %s, want %s", settle.MetaAttempt, got, tc.attempts)
			}
			if n := e.deadTries.Load(); n != tc.deadTries {
				t.Errorf("dead-letter publishes = %d, want %d", n, tc.deadTries)
			}
			if len(dead) != tc.dead || len(poisoned) != tc.poisoned {
				t.Fatalf("dead-letter queue holds %d, poison queue %d; want %d and %d", len(dead), len(poisoned), tc.dead, tc.poisoned)
			}
			if tc.check != nil {
				tc.check(t, e, orig, published, dead, poisoned)
			}
			t.Logf("settled %d deliveries in %v", len(settled), time.Since(start).Round(time.Millisecond))
		})
	}
}

// TestSettleAMQPQuorumDeadLetterByDeliveryCount dead-letters without a
// dedupe store: the attempts are the quorum queue's delivery count
// (x-delivery-count, read by amqpmarshal into settle_delivery_count), so
// even a fresh process would know how many deliveries went before.
func TestSettleAMQPQuorumDeadLetterByDeliveryCount(t *testing.T) {
	t.Parallel()
	e := newSAEnv(t, saOpts{retry: saFastRetry(3, 0), noDedupe: true, quorum: true},
		func(int64, *message.Message) error { return errSAFlaky })
	published := time.Now()
	orig := e.publish()
	e.waitSettled(3)
	dead, poisoned := e.finish()

	settled, seen := e.snapshot()
	if len(settled) != 3 || !errors.Is(settled[0], errSAFlaky) || !errors.Is(settled[1], errSAFlaky) || settled[2] != nil {
		t.Errorf("deliveries = %v, want [nack nack ack]", settled)
	}
	if n := e.calls.Load(); n != 3 {
		t.Errorf("handler calls = %d, want 3", n)
	}
	var counts []string
	for _, md := range seen {
		counts = append(counts, md.Get(settle.MetaDeliveryCount)+"/"+md.Get(settle.MetaAttempt))
	}
	// settle_delivery_count/settle_attempt per call: the first delivery has
	// no x-delivery-count.
	if got, want := fmt.Sprint(counts), "[/1 2/2 3/3]"; got != want {
		t.Errorf("delivery count/attempt per handler call = %s, want %s", got, want)
	}
	if len(dead) != 1 || len(poisoned) != 0 {
		t.Fatalf("dead-letter queue holds %d, poison queue %d; want 1 and 0", len(dead), len(poisoned))
	}
	saCheckParked(t, e, dead[0], orig, settle.DeadLettered, errSAFlaky.Error(), 3, published)
}
