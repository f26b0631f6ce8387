package dedupe_test

import (
	"context"
	"strings"
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
)

// outputRabbit is a hand-built Watermill router on RabbitMQ (watermill-amqp,
// durable queues) with a producing handler behind the dedupe middleware
// configured as getting-started's step 1 shows it: no Config.Publisher.
type outputRabbit struct {
	ch            *amqp091.Channel
	src, out, psn string
	pub           *amqp.Publisher
	runs, effects atomic.Int64
}

// newOutputRabbit builds it, with the poison parking in front of the dedupe
// middleware when withPoison is set; withPublisher gives the middleware the
// router's publisher, and derive makes the handler give its output a
// context it derived and cancels when it returns.
func newOutputRabbit(t *testing.T, withPoison, withPublisher, derive bool) *outputRabbit {
	t.Helper()
	u := testenv.AMQPURL(t)
	db := testenv.SQLite(t)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	must(t, err)
	r := &outputRabbit{src: testenv.Name(t, "src")}
	r.out, r.psn = r.src+".out", r.src+".poison"
	conn, err := amqp091.Dial(u)
	must(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	r.ch, err = conn.Channel()
	must(t, err)
	for _, q := range []string{r.src, r.out, r.psn} {
		_, err := r.ch.QueueDeclare(q, true, false, false, false, nil)
		must(t, err)
		t.Cleanup(func() { _, _ = r.ch.QueueDelete(q, false, false, false) })
	}
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	must(t, err)
	cfg := amqp.NewDurableQueueConfig(u)
	cfg.Publish.ConfirmDelivery = true // parking refuses a publisher that does not wait for the broker
	cfg.Marshaler = m
	r.pub, err = amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = r.pub.Close() })
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	ddCfg := dedupe.Config{Store: store}
	if withPublisher {
		ddCfg.Publisher = r.pub
	}
	dd, err := dedupe.NewMiddleware(ddCfg)
	must(t, err)
	h := router.AddHandler("ship", r.src, sub, r.out, r.pub, func(msg *message.Message) ([]*message.Message, error) {
		r.runs.Add(1)
		r.effects.Add(1) // the side effect: done before the messages are returned
		out := message.NewMessage("ship-"+msg.UUID, msg.Payload)
		if derive {
			ctx, cancel := context.WithTimeout(msg.Context(), time.Minute)
			defer cancel()
			out.SetContext(ctx)
		}
		return []*message.Message{out}, nil
	})
	if withPoison {
		ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: r.pub, Topic: r.psn, Initializer: declaredByTest{}})
		must(t, err)
		h.AddMiddleware(ps)
	}
	h.AddMiddleware(dd)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
	})
	return r
}

// depth is the number of messages ready in q (not those delivered and
// unacked).
func (r *outputRabbit) depth(t *testing.T, q string) int {
	t.Helper()
	st, err := r.ch.QueueDeclarePassive(q, true, false, false, false, nil)
	must(t, err)
	return st.Messages
}

// settled waits until parked reports true (15 s at most), then a second
// more: a redelivery loop would show as more runs by then.
func (r *outputRabbit) settled(t *testing.T, parked func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !parked() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(time.Second)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A producing handler behind the dedupe middleware without
// Config.Publisher, on RabbitMQ: the handler ran 1,960 times in 8 s, its
// side effect each time, and the message never left the queue. Now it runs
// once; the delivery fails permanently, so the poison parking in front
// parks it, and the queue is empty.
func TestOutputWithoutPublisherIsPoisonedOnRabbitMQ(t *testing.T) {
	t.Parallel()
	r := newOutputRabbit(t, true, false, false)
	must(t, r.pub.Publish(r.src, message.NewMessage("order-1", []byte("A-17"))))
	r.settled(t, func() bool { return r.depth(t, r.psn) > 0 })
	if runs, eff, psn, src, out := r.runs.Load(), r.effects.Load(), r.depth(t, r.psn), r.depth(t, r.src), r.depth(t, r.out); runs != 1 || eff != 1 || psn != 1 || src != 0 || out != 0 {
		t.Fatalf("runs=%d effects=%d poisoned=%d left in the queue=%d published=%d; want 1 run, 1 effect, 1 poisoned, 0 left, 0 published",
			runs, eff, psn, src, out)
	}
	d, ok, err := r.ch.Get(r.psn, false)
	must(t, err)
	if !ok {
		t.Fatal("the poison copy went away")
	}
	_ = d.Nack(false, true)
	if reason, _ := d.Headers[settle.MetaReason].(string); !strings.Contains(reason, "Config.Publisher") {
		t.Fatalf("poison copy's reason %q does not name Config.Publisher", reason)
	}
}

// The same router without the poison parking (getting-started's step 1
// exactly): the handler still runs once, its key is confirmed, and the
// redelivery of the failed delivery is acked as a duplicate, so the queue
// empties instead of looping.
func TestOutputWithoutPublisherDoesNotLoopWithoutParking(t *testing.T) {
	t.Parallel()
	r := newOutputRabbit(t, false, false, false)
	must(t, r.pub.Publish(r.src, message.NewMessage("order-1", []byte("A-17"))))
	r.settled(t, func() bool { return r.runs.Load() > 0 && r.depth(t, r.src) == 0 })
	if runs, eff, src, out := r.runs.Load(), r.effects.Load(), r.depth(t, r.src), r.depth(t, r.out); runs != 1 || eff != 1 || src != 0 || out != 0 {
		t.Fatalf("runs=%d effects=%d left in the queue=%d published=%d; want 1 run, 1 effect, 0 left, 0 published", runs, eff, src, out)
	}
}

// A producing handler with Config.Publisher that gives its output a context
// it derived and cancels on return: the middleware publishes after the
// handler returned, and must not publish under that context (watermill-amqp
// refuses to publish under a cancelled one, and every delivery was retried
// until it was dead-lettered). The output is published once, the handler
// runs once, nothing is poisoned.
func TestProducedMessagesOutliveTheHandlersContext(t *testing.T) {
	t.Parallel()
	r := newOutputRabbit(t, true, true, true)
	must(t, r.pub.Publish(r.src, message.NewMessage("order-1", []byte("A-17"))))
	r.settled(t, func() bool { return r.depth(t, r.out)+r.depth(t, r.psn) > 0 })
	if runs, psn, src, out := r.runs.Load(), r.depth(t, r.psn), r.depth(t, r.src), r.depth(t, r.out); runs != 1 || psn != 0 || src != 0 || out != 1 {
		t.Fatalf("runs=%d poisoned=%d left in the queue=%d published=%d; want 1 run, none poisoned, 0 left, 1 published", runs, psn, src, out)
	}
}

// declaredByTest is the parking Initializer of a test that declared the
// parking queue itself.
type declaredByTest struct{}

func (declaredByTest) SubscribeInitialize(string) error { return nil }
