package integration_test

import (
	"encoding/json"
	"errors"
	"maps"
	"strings"
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
	"github.com/settle-go/settle/internal/testenv"
)

// marshalWait bounds every wait for the broker in these tests.
const marshalWait = 20 * time.Second

// marshalQuiet is how long a handler's call count must stay unchanged to
// count as "no more redeliveries".
const marshalQuiet = 500 * time.Millisecond

// received is what the handler saw of one delivery.
type received struct {
	UUID     string
	Payload  string
	Metadata message.Metadata
}

// marshalEnv is one real queue, a raw amqp091 connection to publish into and
// inspect it, and a Watermill router consuming it.
type marshalEnv struct {
	t      *testing.T
	url    string
	queue  string
	quorum bool
	ch     *amqp091.Channel

	mu    sync.Mutex
	calls []received

	stopRouter func() // set once the router runs
}

func newMarshalEnv(t *testing.T, quorum bool) *marshalEnv {
	t.Helper()
	url := testenv.AMQPURL(t)
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatalf("dial RabbitMQ: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	e := &marshalEnv{t: t, url: url, queue: testenv.Name(t, "marshal"), quorum: quorum, ch: ch}
	if _, err := ch.QueueDeclare(e.queue, true, false, false, false, e.queueArgs()); err != nil {
		t.Fatalf("declare %s: %v", e.queue, err)
	}
	t.Cleanup(func() {
		// Registered after conn.Close, so it runs before it; a fresh channel
		// in case a failed call closed ch.
		cleanup, err := conn.Channel()
		if err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
			return
		}
		defer func() { _ = cleanup.Close() }()
		if _, err := cleanup.QueueDelete(e.queue, false, false, false); err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
		}
	})
	return e
}

func (e *marshalEnv) queueArgs() amqp091.Table {
	if e.quorum {
		return amqp091.Table{"x-queue-type": "quorum"}
	}
	return nil
}

func (e *marshalEnv) publish(p amqp091.Publishing) {
	e.t.Helper()
	p.DeliveryMode = amqp091.Persistent
	conf, err := e.ch.PublishWithDeferredConfirmWithContext(e.t.Context(), "", e.queue, true, false, p)
	if err != nil {
		e.t.Fatalf("publish: %v", err)
	}
	ok, err := conf.WaitContext(e.t.Context())
	if err != nil || !ok {
		e.t.Fatalf("publish not confirmed: %v %v", ok, err)
	}
}

// start runs a router with a watermill-amqp subscriber using marshaler on
// the queue; handler decides what each delivery returns (nil: ack) after it
// has been recorded.
func (e *marshalEnv) start(marshaler amqp.Marshaler, logger watermill.LoggerAdapter, handler func(n int, msg *message.Message) error) {
	e.t.Helper()
	cfg := amqp.NewDurableQueueConfig(e.url)
	cfg.Marshaler = marshaler
	cfg.Queue.Arguments = e.queueArgs()
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(e.t, logger))
	if err != nil {
		e.t.Fatalf("new subscriber: %v", err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		e.t.Fatal(err)
	}
	router.AddConsumerHandler("record", e.queue, sub, func(msg *message.Message) error {
		e.mu.Lock()
		e.calls = append(e.calls, received{UUID: msg.UUID, Payload: string(msg.Payload), Metadata: maps.Clone(msg.Metadata)})
		n := len(e.calls)
		e.mu.Unlock()
		return handler(n, msg)
	})
	e.stopRouter = runRouter(e.t, router, marshalWait)
}

// stop closes the router (which closes the subscriber) and waits for Run to
// return. Safe to call twice.
func (e *marshalEnv) stop() {
	if e.stopRouter != nil {
		e.stopRouter()
	}
}

func (e *marshalEnv) received() []received {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]received(nil), e.calls...)
}

// waitCalls polls until the handler has been called n times, then until the
// count has stayed the same for marshalQuiet, and returns the calls.
func (e *marshalEnv) waitCalls(n int) []received {
	e.t.Helper()
	deadline := time.Now().Add(marshalWait)
	for len(e.received()) < n {
		if time.Now().After(deadline) {
			e.t.Fatalf("handler called %d times, want %d: %+v", len(e.received()), n, e.received())
		}
		time.Sleep(10 * time.Millisecond)
	}
	stableSince, last := time.Now(), len(e.received())
	for time.Since(stableSince) < marshalQuiet {
		time.Sleep(20 * time.Millisecond)
		if got := len(e.received()); got != last {
			stableSince, last = time.Now(), got
		}
	}
	calls := e.received()
	if len(calls) != n {
		e.t.Fatalf("handler called %d times, want exactly %d: %+v", len(calls), n, calls)
	}
	return calls
}

// queueAfterStop stops the router and returns the queue's ready message
// count once its consumer is gone, when unacked messages would be back in it.
func (e *marshalEnv) queueAfterStop() (messages int) {
	e.t.Helper()
	e.stop()
	deadline := time.Now().Add(marshalWait)
	for {
		q, err := e.ch.QueueDeclarePassive(e.queue, true, false, false, false, e.queueArgs())
		if err != nil {
			e.t.Fatalf("inspect %s: %v", e.queue, err)
		}
		if q.Consumers == 0 {
			return q.Messages
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("queue %s still has %d consumers after the router stopped", e.queue, q.Consumers)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func marshalTypes(t *testing.T, md message.Metadata) map[string]string {
	t.Helper()
	raw, ok := md[amqpmarshal.MetaHeaderTypes]
	if !ok {
		return nil
	}
	var types map[string]string
	if err := json.Unmarshal([]byte(raw), &types); err != nil {
		t.Fatalf("%s = %q: %v", amqpmarshal.MetaHeaderTypes, raw, err)
	}
	return types
}

func newSettleMarshaler(t *testing.T) amqpmarshal.Marshaler {
	t.Helper()
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Every message the stock marshaler would refuse reaches the handler exactly
// once with its headers as metadata, and is acked.
func TestAMQPMarshalerDeliversEveryMessageOnce(t *testing.T) {
	t.Parallel()
	uuidKey := amqp.DefaultMessageUUIDHeaderKey
	cases := []struct {
		body      string
		pub       amqp091.Publishing
		wantUUID  string
		wantMeta  message.Metadata
		wantTypes map[string]string
	}{
		{
			body:      "int32",
			pub:       amqp091.Publishing{Headers: amqp091.Table{uuidKey: "u-int32", "n": int32(42)}},
			wantUUID:  "u-int32",
			wantMeta:  message.Metadata{"n": "42"},
			wantTypes: map[string]string{"n": "int32"},
		},
		{
			body:      "bool",
			pub:       amqp091.Publishing{Headers: amqp091.Table{uuidKey: "u-bool", "flag": true, "s": "str"}},
			wantUUID:  "u-bool",
			wantMeta:  message.Metadata{"flag": "true", "s": "str"},
			wantTypes: map[string]string{"flag": "bool"},
		},
		{
			body: "table",
			pub: amqp091.Publishing{Headers: amqp091.Table{
				uuidKey: "u-table",
				"t":     amqp091.Table{"a": int32(1), "b": "x", "c": amqp091.Table{"d": true}, "e": []any{int32(2), "y"}},
			}},
			wantUUID:  "u-table",
			wantMeta:  message.Metadata{"t": `{"a":1,"b":"x","c":{"d":true},"e":[2,"y"]}`},
			wantTypes: map[string]string{"t": "table"},
		},
		{
			body:     "message-id",
			pub:      amqp091.Publishing{MessageId: "u-message-id", Headers: amqp091.Table{"k": "v"}},
			wantUUID: "u-message-id",
			wantMeta: message.Metadata{"k": "v"},
		},
		{
			body:     "no-id",
			pub:      amqp091.Publishing{Headers: amqp091.Table{"k": "none"}},
			wantUUID: "",
			wantMeta: message.Metadata{"k": "none"},
		},
	}
	for _, queue := range []struct {
		name   string
		quorum bool
	}{{"classic", false}, {"quorum", true}} {
		t.Run(queue.name, func(t *testing.T) {
			t.Parallel()
			e := newMarshalEnv(t, queue.quorum)
			for _, c := range cases {
				p := c.pub
				p.Body = []byte(c.body)
				e.publish(p)
			}
			e.start(newSettleMarshaler(t), watermill.NopLogger{}, func(int, *message.Message) error { return nil })

			calls := e.waitCalls(len(cases))
			byBody := map[string]received{}
			for _, r := range calls {
				if _, dup := byBody[r.Payload]; dup {
					t.Fatalf("message %q handled twice: %+v", r.Payload, calls)
				}
				byBody[r.Payload] = r
			}
			for _, c := range cases {
				r, ok := byBody[c.body]
				if !ok {
					t.Fatalf("message %q never reached the handler: %+v", c.body, calls)
				}
				if r.UUID != c.wantUUID {
					t.Errorf("%s: UUID %q, want %q", c.body, r.UUID, c.wantUUID)
				}
				want := maps.Clone(c.wantMeta)
				want[settle.MetaRedelivered] = "false"
				if c.wantTypes != nil {
					types, _ := json.Marshal(c.wantTypes)
					want[amqpmarshal.MetaHeaderTypes] = string(types)
				}
				if !maps.Equal(r.Metadata, want) {
					t.Errorf("%s: metadata %v, want %v", c.body, r.Metadata, want)
				}
				if got := marshalTypes(t, r.Metadata); !maps.Equal(got, c.wantTypes) {
					t.Errorf("%s: header types %v, want %v", c.body, got, c.wantTypes)
				}
			}
			if n := e.queueAfterStop(); n != 0 {
				t.Fatalf("%d messages left in %s after the router stopped: not all were acked", n, e.queue)
			}
		})
	}
}

// On a quorum queue the retry middleware can read the broker's delivery
// count: a handler that fails once sees settle_delivery_count "2" on the
// redelivery.
func TestAMQPMarshalerQuorumDeliveryCount(t *testing.T) {
	t.Parallel()
	e := newMarshalEnv(t, true)
	e.publish(amqp091.Publishing{
		Headers: amqp091.Table{amqp.DefaultMessageUUIDHeaderKey: "u-retry"},
		Body:    []byte("retry me"),
	})
	errFirst := errors.New("first delivery fails")
	quorum, err := amqpmarshal.New(amqpmarshal.Config{QuorumQueue: true})
	if err != nil {
		t.Fatal(err)
	}
	e.start(quorum, watermill.NopLogger{}, func(n int, _ *message.Message) error {
		if n == 1 {
			return errFirst
		}
		return nil
	})

	calls := e.waitCalls(2)
	first, second := calls[0], calls[1]
	for i, r := range calls {
		if r.UUID != "u-retry" || r.Payload != "retry me" {
			t.Fatalf("call %d: UUID %q payload %q", i+1, r.UUID, r.Payload)
		}
	}
	if got := first.Metadata[settle.MetaRedelivered]; got != "false" {
		t.Errorf("first delivery: %s = %q, want false", settle.MetaRedelivered, got)
	}
	if got, ok := first.Metadata[settle.MetaDeliveryCount]; ok {
		t.Errorf("first delivery: %s = %q, want absent (no x-delivery-count yet)", settle.MetaDeliveryCount, got)
	}
	if got := second.Metadata[settle.MetaRedelivered]; got != "true" {
		t.Errorf("second delivery: %s = %q, want true", settle.MetaRedelivered, got)
	}
	if got := second.Metadata[settle.MetaDeliveryCount]; got != "2" {
		t.Errorf("second delivery: %s = %q, want 2", settle.MetaDeliveryCount, got)
	}
	if got := second.Metadata["x-delivery-count"]; got != "1" {
		t.Errorf("second delivery: %s = %q, want 1", "x-delivery-count", got)
	}
	typ := marshalTypes(t, second.Metadata)["x-delivery-count"]
	switch typ {
	case "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64":
		t.Logf("RabbitMQ sends %s as %s", "x-delivery-count", typ)
	default:
		t.Errorf("second delivery: type of %s recorded as %q, want an integer type", "x-delivery-count", typ)
	}
	if n := e.queueAfterStop(); n != 0 {
		t.Fatalf("%d messages left after the second delivery was acked", n)
	}
}

// nackCounter counts the watermill-amqp subscriber's "Processing message
// failed, sending nack" errors: each one is a delivery the marshaler refused
// and the subscriber requeued.
type nackCounter struct {
	watermill.LoggerAdapter
	nacks *atomic.Int64
}

func (l nackCounter) Error(msg string, err error, fields watermill.LogFields) {
	if strings.HasPrefix(msg, "Processing message failed") {
		l.nacks.Add(1)
	}
}

func (l nackCounter) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return nackCounter{LoggerAdapter: l.LoggerAdapter.With(fields), nacks: l.nacks}
}

// Documents the problem amqpmarshal fixes: with watermill-amqp's
// DefaultMarshaler one int32 header makes the subscriber nack and requeue the
// message in a hot loop, and it never reaches the handler.
func TestAMQPDefaultMarshalerHotLoopsOnInt32Header(t *testing.T) {
	t.Parallel()
	e := newMarshalEnv(t, false)
	e.publish(amqp091.Publishing{
		Headers: amqp091.Table{amqp.DefaultMessageUUIDHeaderKey: "u-loop", "n": int32(42)},
		Body:    []byte("never handled"),
	})
	var nacks atomic.Int64
	start := time.Now()
	e.start(amqp.DefaultMarshaler{}, nackCounter{LoggerAdapter: watermill.NopLogger{}, nacks: &nacks},
		func(int, *message.Message) error { return nil })

	deadline := start.Add(marshalWait)
	for nacks.Load() <= 100 {
		if time.Now().After(deadline) {
			t.Fatalf("only %d redeliveries in %v; expected the stock marshaler to hot-loop", nacks.Load(), marshalWait)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// And it does not stop by itself.
	more := nacks.Load() + 100
	for nacks.Load() < more {
		if time.Now().After(deadline) {
			t.Fatalf("the redelivery loop stopped at %d", nacks.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	elapsed := time.Since(start)
	left := e.queueAfterStop()
	t.Logf("DefaultMarshaler: %d refusals and requeues in %v, 0 handler calls", nacks.Load(), elapsed.Round(time.Millisecond))
	if calls := e.received(); len(calls) != 0 {
		t.Fatalf("handler reached %d times; the stock marshaler should refuse the message: %+v", len(calls), calls)
	}
	if left != 1 {
		t.Fatalf("%d messages left in the queue, want 1: the refused message is never acked", left)
	}
}
