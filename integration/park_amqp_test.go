package integration_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// parkWait bounds every wait of the parking tests on RabbitMQ.
const parkWait = 90 * time.Second

// parkSubscribers are the two RabbitMQ subscribers the parking tests run
// with.
var parkSubscribers = []string{"watermill-amqp", "amqpsub"}

// parkEnv is a newcomer's pipeline on RabbitMQ: watermill-amqp's durable
// queue configuration with settle's marshaler and publisher confirms, and
// nothing declared by hand: the subscriber declares the source queue, and
// the pipeline the parking queues.
type parkEnv struct {
	t         *testing.T
	url, src  string
	cfg       amqp.Config
	marshaler amqpmarshal.Marshaler
	conn      *amqp091.Connection // raw: publish, inspect, drain

	mu   sync.Mutex
	runs map[string]int // handler runs per message UUID
}

func newParkEnv(t *testing.T) *parkEnv {
	t.Helper()
	e := &parkEnv{t: t, url: testenv.AMQPURL(t), src: testenv.Name(t, "park"), runs: map[string]int{}}
	var err error
	e.marshaler, err = amqpmarshal.New(amqpmarshal.Config{})
	saMust(t, err)
	e.cfg = amqp.NewDurableQueueConfig(e.url)
	e.cfg.Marshaler = e.marshaler
	e.cfg.Publish.ConfirmDelivery = true
	e.conn, err = amqp091.Dial(e.url)
	saMust(t, err)
	t.Cleanup(func() {
		_ = e.conn.Close()
		// The queues are this test's own: the source, declared by the
		// subscriber, and the two parking queues, declared by settle. On a
		// connection of its own, in case the broker closed the test's.
		conn, err := amqp091.Dial(e.url)
		if err != nil {
			t.Errorf("delete the test's queues: %v", err)
			return
		}
		defer conn.Close()
		if ch, err := conn.Channel(); err == nil {
			for _, q := range []string{e.src, e.dead(), e.poison()} {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
		}
	})
	return e
}

func (e *parkEnv) dead() string   { return e.src + ".dead_letter" }
func (e *parkEnv) poison() string { return e.src + ".poison" }

// start runs a pipeline handler on the source queue with the given
// subscriber kind; handle decides each run.
func (e *parkEnv) start(kind string, handle func(msg *message.Message) error) (stop func()) {
	t := e.t
	t.Helper()
	logger := testenv.AMQPLogger(t, nil)
	var sub message.Subscriber
	switch kind {
	case "watermill-amqp":
		s, err := amqp.NewSubscriber(e.cfg, logger)
		saMust(t, err)
		t.Cleanup(func() { _ = s.Close() })
		sub = s
	case "amqpsub":
		s, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: e.cfg, InFlight: 4}, logger)
		saMust(t, err)
		t.Cleanup(func() { _ = s.Close() })
		sub = s
	default:
		t.Fatalf("unknown subscriber %q", kind)
	}
	pub, err := amqp.NewPublisher(e.cfg, logger)
	saMust(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: parkWait}, watermill.NopLogger{})
	saMust(t, err)
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: pub, Retry: saFastRetry(2, 0), NackDelay: 10 * time.Millisecond, DisableTracing: true,
	})
	saMust(t, err)
	_, err = p.Handle("park_handler", e.src, sub, func(msg *message.Message) error {
		e.mu.Lock()
		e.runs[msg.UUID]++
		e.mu.Unlock()
		return handle(msg)
	})
	saMust(t, err)
	return runRouter(t, router, parkWait)
}

// publish puts a raw publishing on the source queue, declaring it first as
// the subscriber does (durable, no arguments), so that nothing published
// before the router runs is lost.
func (e *parkEnv) publish(p amqp091.Publishing) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	saMust(e.t, err)
	defer ch.Close()
	_, err = ch.QueueDeclare(e.src, true, false, false, false, nil)
	saMust(e.t, err)
	saMust(e.t, ch.Confirm(false))
	conf, err := ch.PublishWithDeferredConfirmWithContext(e.t.Context(), "", e.src, false, false, p)
	saMust(e.t, err)
	if ok, err := conf.WaitContext(e.t.Context()); err != nil || !ok {
		e.t.Fatalf("publish not confirmed: %v %v", ok, err)
	}
}

// depth returns the number of ready messages in queue, and false when the
// queue does not exist.
func (e *parkEnv) depth(queue string) (int, bool) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	saMust(e.t, err)
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		var aerr *amqp091.Error
		if errors.As(err, &aerr) && aerr.Code == amqp091.NotFound {
			return 0, false
		}
		e.t.Fatalf("inspect %s: %v", queue, err)
	}
	_ = ch.Close()
	return q.Messages, true
}

// drain gets and acks every message of queue; a queue that does not exist
// holds none.
func (e *parkEnv) drain(queue string) []*message.Message {
	e.t.Helper()
	if _, ok := e.depth(queue); !ok {
		return nil
	}
	ch, err := e.conn.Channel()
	saMust(e.t, err)
	defer ch.Close()
	return saDrain(e.t, ch, e.marshaler, queue)
}

// waitFor polls cond until it holds or parkWait has passed, and reports
// whether it held.
func (e *parkEnv) waitFor(cond func() bool) bool {
	deadline := time.Now().Add(parkWait)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// parked reports whether the dead-letter and poison queues hold at least
// dead and poisoned copies.
func (e *parkEnv) parked(dead, poisoned int) bool {
	d, _ := e.depth(e.dead())
	p, _ := e.depth(e.poison())
	return d >= dead && p >= poisoned
}

// finish stops the router (its unacked deliveries go back to the queue) and
// reports how many messages the source queue holds then. It first leaves
// the subscriber a moment to send the acks of deliveries that have just
// settled: watermill-amqp's subscriber may drop an ack it had not sent yet
// when its subscription is closed (the message is then redelivered, not
// lost), which would be counted here as a message left behind.
func (e *parkEnv) finish(stop func()) int {
	e.t.Helper()
	time.Sleep(250 * time.Millisecond)
	stop()
	ch, err := e.conn.Channel()
	saMust(e.t, err)
	defer ch.Close()
	return saQueueAfterConsumersLeft(e.t, ch, e.src, nil)
}

// runsOf returns a copy of the handler runs per UUID.
func (e *parkEnv) runsOf() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make(map[string]int, len(e.runs))
	for k, v := range e.runs {
		out[k] = v
	}
	return out
}

// The newcomer's pipeline parks what it must on a broker where nobody
// declared the parking queues: settle declares them, with the handler's
// subscriber, before each copy. Before, RabbitMQ dropped every copy (and
// confirmed it) and settle acked the original: 3 dead letters and 4 poison
// messages lost.
func TestParkingQueuesDeclaredOnTheDefaultPath(t *testing.T) {
	t.Parallel()
	for _, kind := range parkSubscribers {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			e := newParkEnv(t)
			sent := map[string]string{} // UUID -> kind
			for i, k := range []string{"good", "dead", "poison", "dead", "poison", "good", "poison", "dead", "poison"} {
				id := watermill.NewUUID()
				sent[id] = k
				e.publish(amqp091.Publishing{MessageId: id, Body: []byte(k), DeliveryMode: amqp091.Persistent,
					Headers: amqp091.Table{"n": int32(i)}})
			}
			stop := e.start(kind, func(msg *message.Message) error {
				switch string(msg.Payload) {
				case "dead":
					return errors.New("the payment provider is down")
				case "poison":
					return poison.Permanent(errors.New("order has no customer"))
				}
				return nil
			})
			e.waitFor(func() bool { return len(e.runsOf()) == len(sent) && e.parked(3, 4) })
			if n := e.finish(stop); n != 0 {
				t.Errorf("source queue holds %d messages after the router closed, want 0", n)
			}
			dead, poisoned := e.drain(e.dead()), e.drain(e.poison())
			checkParked(t, "dead letter", dead, sent, "dead", settle.DeadLettered)
			checkParked(t, "poison", poisoned, sent, "poison", settle.Poisoned)
			runs := e.runsOf()
			for id, k := range sent {
				if want := map[string]int{"good": 1, "dead": 2, "poison": 1}[k]; runs[id] != want {
					t.Errorf("%s message %s ran %d times, want %d", k, id, runs[id], want)
				}
			}
		})
	}
}

// checkParked checks that the copies on a parking queue are exactly the sent
// messages of kind, with their outcome.
func checkParked(t *testing.T, what string, got []*message.Message, sent map[string]string, kind string, outcome settle.Outcome) {
	t.Helper()
	want := 0
	for _, k := range sent {
		if k == kind {
			want++
		}
	}
	if len(got) != want {
		t.Errorf("%d %s copies on the queue, want %d", len(got), what, want)
	}
	for _, m := range got {
		id := m.Metadata.Get(settle.MetaOriginalUUID)
		if sent[id] != kind || m.Metadata.Get(settle.MetaOutcome) != string(outcome) {
			t.Errorf("%s copy of %q (%s): outcome %q", what, id, sent[id], m.Metadata.Get(settle.MetaOutcome))
		}
	}
}

// A pipeline, or a parking middleware, refuses a watermill-amqp publisher
// that does not wait for the broker's confirmation: a copy it lost would be
// taken as parked.
func TestParkingRefusesAnUnconfirmedPublisher(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	cfg := amqp.NewDurableQueueConfig(url)
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	saMust(t, err)
	if _, err := pipeline.New(router, pipeline.Config{Publisher: pub}); !errors.Is(err, middleware.ErrUnconfirmedPublisher) ||
		!strings.Contains(err.Error(), "ConfirmDelivery") {
		t.Errorf("pipeline.New with an unconfirmed publisher: %v, want %v", err, middleware.ErrUnconfirmedPublisher)
	}
	if _, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: "t"}); !errors.Is(err, middleware.ErrUnconfirmedPublisher) {
		t.Errorf("NewDeadLetter with an unconfirmed publisher: %v", err)
	}
	cfg.Publish.ConfirmDelivery = true
	confirmed, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() { _ = confirmed.Close() })
	if _, err := pipeline.New(router, pipeline.Config{Publisher: confirmed}); err != nil {
		t.Errorf("pipeline.New with a confirming publisher: %v", err)
	}
}

// A message the broker accepted can always be parked, and does not hold
// the messages behind it: six with a 96 KiB binary header (the broker takes
// it, its frame_max being 128 KiB) whose base64 text no longer fits in a
// frame, and one whose handler's error text is 200 KiB. Before, the copy
// could never be published: the message went back to the head of the queue
// and was parked again, forever, and the five good messages behind it were
// never handled.
func TestParkingOversizedCopies(t *testing.T) {
	t.Parallel()
	for _, kind := range parkSubscribers {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			e := newParkEnv(t)
			blob := make([]byte, 96<<10)
			for i := range blob {
				blob[i] = byte(i * 7)
			}
			sent := map[string]string{}
			send := func(k string, h amqp091.Table) {
				id := watermill.NewUUID()
				sent[id] = k
				if h == nil {
					h = amqp091.Table{}
				}
				h["keep"] = "small"
				e.publish(amqp091.Publishing{MessageId: id, Body: []byte(k), DeliveryMode: amqp091.Persistent, Headers: h})
			}
			// More of them than amqpsub's InFlight (4): each held a slot.
			for range 6 {
				send("poison", amqp091.Table{"x-blob": blob})
			}
			// Thousands of tiny integer headers (56 KiB as the broker got
			// them) whose text form takes twice that. (amqp091 refuses a
			// table of more than 8192 entries: it closes the connection of
			// a consumer that is sent one, which RabbitMQ accepts.)
			tiny := amqp091.Table{}
			for i := range 8000 {
				tiny[fmt.Sprintf("%04x", i)] = int8(-100)
			}
			send("poison", tiny)
			send("dead", nil)
			for range 5 {
				send("good", nil)
			}
			stop := e.start(kind, func(msg *message.Message) error {
				switch string(msg.Payload) {
				case "dead":
					return errors.New("upstream said: " + strings.Repeat("no ", 200<<10/3))
				case "poison":
					return poison.Permanent(errors.New("undecodable"))
				}
				return nil
			})
			e.waitFor(func() bool {
				runs := e.runsOf()
				good := 0
				for id, k := range sent {
					if k == "good" && runs[id] > 0 {
						good++
					}
				}
				return good == 5 && e.parked(1, 7)
			})
			if n := e.finish(stop); n != 0 {
				t.Errorf("source queue holds %d messages after the router closed, want 0", n)
			}
			runs := e.runsOf()
			for id, k := range sent {
				if k == "good" && runs[id] != 1 {
					t.Errorf("good message %s ran %d times, want 1", id, runs[id])
				}
			}
			dead, poisoned := e.drain(e.dead()), e.drain(e.poison())
			checkParked(t, "dead letter", dead, sent, "dead", settle.DeadLettered)
			checkParked(t, "poison", poisoned, sent, "poison", settle.Poisoned)
			for _, cp := range poisoned {
				md := cp.Metadata
				if dropped := md.Get(middleware.MetaDroppedHeaders); !strings.Contains(dropped, `"x-blob"`) {
					// The copy of the message with tiny headers: the
					// largest of them are left out, "keep" among them.
					if !strings.Contains(dropped, `"names":["0000","0001"`) || md.Get("1f3f") == "" {
						t.Errorf("copy with tiny headers: %s = %.80q, 1f3f = %q", middleware.MetaDroppedHeaders, dropped, md.Get("1f3f"))
					}
					continue
				}
				if md.Get("x-blob") != "" || !strings.Contains(md.Get(middleware.MetaDroppedHeaders), `"x-blob"`) {
					t.Errorf("poison copy: x-blob %d bytes, %s = %q; want it dropped and named",
						len(md.Get("x-blob")), middleware.MetaDroppedHeaders, md.Get(middleware.MetaDroppedHeaders))
				}
				if md.Get("keep") != "small" {
					t.Errorf("poison copy lost the small header: %v", md.Get("keep"))
				}
			}
			if len(dead) == 1 {
				if r := dead[0].Metadata.Get(settle.MetaReason); len(r) > 4<<10 || !strings.HasPrefix(r, "upstream said: no no") || !strings.HasSuffix(r, "bytes cut]") {
					t.Errorf("dead letter reason of %d bytes: %.60q…%q", len(r), r, r[max(0, len(r)-30):])
				}
			}
		})
	}
}
