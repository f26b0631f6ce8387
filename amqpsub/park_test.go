package amqpsub_test

import (
	"context"
	"errors"
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
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// breakingInitializer declares a topic through its subscriber and then,
// while broken is set, has the route taken away before the copy is
// published (broken is called after each declaration): a queue deleted
// between the declaration and the publish.
type breakingInitializer struct {
	sub    message.SubscribeInitializer
	broken atomic.Bool
	after  func(topic string)
	calls  atomic.Int64
}

func (b *breakingInitializer) SubscribeInitialize(topic string) error {
	b.calls.Add(1)
	if err := b.sub.SubscribeInitialize(topic); err != nil {
		return err
	}
	if b.broken.Load() && b.after != nil {
		b.after(topic)
	}
	return nil
}

// countingLog keeps the error logs (messages and errors) it is given.
type countingLog struct {
	watermill.NopLogger
	mu    sync.Mutex
	errs  []string
	infos []string
}

func (l *countingLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, msg+": "+err.Error())
}

func (l *countingLog) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.infos = append(l.infos, msg)
}

func (l *countingLog) parked() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.infos {
		if strings.HasSuffix(m, "message parked") {
			return true
		}
	}
	return false
}

func (l *countingLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *countingLog) matching(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.errs {
		if strings.Contains(e, s) {
			n++
		}
	}
	return n
}

// parkScenario is a route for the poison copies that is broken until fixed:
// the copy reaches no queue, and RabbitMQ confirms it all the same.
type parkScenario struct {
	name string
	// publisher edits the publisher's configuration.
	publisher func(cfg *amqp.Config, exchange string)
	// breakRoute runs after each declaration of the parking topic while the
	// route is broken.
	breakRoute func(t *testing.T, f *pubFixture, queue string)
	// fixRoute makes the route exist.
	fixRoute func(t *testing.T, f *pubFixture, queue, exchange string)
}

var parkScenarios = []parkScenario{{
	// The parking queue is declared before each copy, and deleted (by an
	// operator, by another process) before the copy is published.
	name:      "queue deleted after the declaration",
	publisher: func(*amqp.Config, string) {},
	breakRoute: func(t *testing.T, f *pubFixture, queue string) {
		ch, err := f.conn.Channel()
		if err != nil {
			t.Error(err)
			return
		}
		defer ch.Close()
		if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
			t.Error(err)
		}
	},
	fixRoute: func(*testing.T, *pubFixture, string, string) {}, // the next declaration stays
}, {
	// The publisher's configuration routes the topic to an exchange that no
	// queue is bound to, while the subscriber declares the parking queue on
	// the default exchange.
	name: "exchange with no queue bound",
	publisher: func(cfg *amqp.Config, exchange string) {
		cfg.Exchange.GenerateName = amqp.GenerateExchangeNameConstant(exchange)
		cfg.Exchange.Type = "fanout"
		cfg.Publish.GenerateRoutingKey = func(string) string { return "" }
	},
	fixRoute: func(t *testing.T, f *pubFixture, queue, exchange string) {
		ch, err := f.conn.Channel()
		must(t, err)
		defer ch.Close()
		must(t, ch.QueueBind(queue, "", exchange, false, nil))
	},
}}

// parkRun is one run of a hand-built router with poison parking whose
// copies have no route until fixed.
type parkRun struct {
	f                       *pubFixture
	work, parking, exchange string
	init                    *breakingInitializer
	runs                    atomic.Int64 // handler runs
	log                     *countingLog
	stop                    func()
}

// startPark starts a router that consumes one message from a queue of its
// own with amqpsub's subscriber and poisons it, parking the copy through
// pub (built by newPub from the scenario's configuration).
func startPark(t *testing.T, sc parkScenario, newPub func(t *testing.T, cfg amqp.Config, log watermill.LoggerAdapter) message.Publisher) *parkRun {
	t.Helper()
	f := newPubFixture(t)
	r := &parkRun{f: f, work: testenv.Name(t, "w"), parking: testenv.Name(t, "pq"), exchange: testenv.Name(t, "x"), log: &countingLog{}}
	exchange := r.exchange
	f.queue(t, r.work)
	f.cleanup(t, func(ch *amqp091.Channel) {
		_, _ = ch.QueueDelete(r.parking, false, false, false)
		_ = ch.ExchangeDelete(exchange, false, false)
	})
	subCfg := f.config(t)
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: subCfg, InFlight: 1}, nil)
	must(t, err)
	pubCfg := f.config(t)
	sc.publisher(&pubCfg, exchange)
	pub := newPub(t, pubCfg, r.log)
	r.init = &breakingInitializer{sub: sub}
	if sc.breakRoute != nil {
		r.init.after = func(topic string) { sc.breakRoute(t, f, topic) }
	}
	r.init.broken.Store(true)

	ps, err := middleware.NewPoison(middleware.ParkConfig{
		Publisher: pub, Topic: r.parking, Initializer: r.init, NackDelay: 50 * time.Millisecond, Logger: r.log,
	})
	must(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	must(t, err)
	router.AddConsumerHandler("h", r.work, sub, func(*message.Message) error {
		r.runs.Add(1)
		return poison.Permanent(errors.New("order has no currency"))
	})
	router.AddMiddleware(ps)

	ch, err := f.conn.Channel()
	must(t, err)
	must(t, ch.PublishWithContext(t.Context(), "", r.work, false, false, amqp091.Publishing{
		MessageId: "order-17", DeliveryMode: amqp091.Persistent, Body: []byte(`{}`),
	}))
	_ = ch.Close()

	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- router.Run(ctx) }()
	<-router.Running()
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			must(t, router.Close())
			must(t, <-errc)
			must(t, sub.Close())
			must(t, pub.Close())
		})
	}
	t.Cleanup(r.stop)
	return r
}

// messages is how many messages wait in queue (0 when it does not exist).
func (r *parkRun) messages(t *testing.T, queue string) int {
	t.Helper()
	ch, err := r.f.conn.Channel()
	must(t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0 // NOT_FOUND
	}
	return q.Messages
}

// waitFor polls cond for up to 60s.
func waitFor(cond func() bool) bool {
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

func amqpsubPublisher(t *testing.T, cfg amqp.Config, log watermill.LoggerAdapter) message.Publisher {
	t.Helper()
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, log)
	must(t, err)
	return pub
}

func watermillPublisher(t *testing.T, cfg amqp.Config, log watermill.LoggerAdapter) message.Publisher {
	t.Helper()
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	return pub
}

// A poison copy parked through amqpsub's Publisher that the broker routes
// to no queue is a failed park: the original is not acked but deferred (it
// comes back, and is parked again without a run of the handler), and once
// the route exists the copy lands on the parking queue and the original is
// acked. Red with watermill-amqp's Publisher in its place (with
// ConfirmDelivery): the first copy is confirmed, the original acked, and
// both are gone; see TestWatermillAMQPPublisherLosesUnroutedCopies.
func TestUnroutedCopyIsAFailedPark(t *testing.T) {
	t.Parallel()
	for _, sc := range parkScenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			r := startPark(t, sc, amqpsubPublisher)
			// Four parks: the original came back three times.
			if !waitFor(func() bool { return r.init.calls.Load() >= 4 }) {
				t.Fatalf("%d park(s) within 60s, want 4: the original was acked after a copy routed to no queue "+
					"(%d message(s) on the work queue, %d on the parking queue)",
					r.init.calls.Load(), r.messages(t, r.work), r.messages(t, r.parking))
			}
			if n := r.log.matching(amqpsub.ErrUnroutable.Error()); n == 0 {
				t.Errorf("no failed park logged with ErrUnroutable: %q", r.log.errs)
			}
			sc.fixRoute(t, r.f, r.parking, r.exchange)
			r.init.broken.Store(false)
			if !waitFor(func() bool { return r.messages(t, r.parking) == 1 }) {
				t.Fatalf("the copy is not on the parking queue 60s after the route was made (%d there)", r.messages(t, r.parking))
			}
			// The router acks the original once the middleware returned:
			// give it a moment before closing.
			if !waitFor(r.log.parked) {
				t.Fatal("no park logged 60s after the copy landed")
			}
			time.Sleep(200 * time.Millisecond)
			r.stop()
			if n := r.messages(t, r.work); n != 0 {
				t.Errorf("%d message(s) on the work queue after the copy was parked, want 0 (the original acked); %d parks, log %q", n, r.init.calls.Load(), r.log.errs)
			}
			if n := r.runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times, want 1 (a deferred park runs nothing again)", n)
			}
			got := r.f.drain(t, r.parking)
			if len(got) != 1 || got["order-17"] != 1 {
				t.Errorf("parking queue holds %v, want order-17 once", got)
			}
			if n := r.log.matching("amqpsub.NewPublisher"); n != 0 {
				t.Errorf("the warning for watermill-amqp's publisher was logged for amqpsub's (%d times)", n)
			}
		})
	}
}

// What the publisher above is for: with watermill-amqp's Publisher (with
// ConfirmDelivery) in the same setup, the copy that reached no queue is
// confirmed, the original acked, and both are gone. The parking middleware
// warns at construction that it cannot see this. If this test fails,
// watermill-amqp reports returns now, and docs/poison.md and the warning are
// to be changed.
func TestWatermillAMQPPublisherLosesUnroutedCopies(t *testing.T) {
	t.Parallel()
	for _, sc := range parkScenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			r := startPark(t, sc, watermillPublisher)
			if n := r.log.matching("amqpsub.NewPublisher"); n != 1 {
				t.Errorf("the warning for watermill-amqp's publisher was logged %d times at construction, want 1: %q", n, r.log.errs)
			}
			if !waitFor(func() bool { return r.messages(t, r.work) == 0 && r.init.calls.Load() >= 1 }) {
				t.Fatal("the message was not taken off the work queue within 60s")
			}
			time.Sleep(500 * time.Millisecond) // a redelivery would have come by now
			r.stop()
			work, parked := r.messages(t, r.work), r.messages(t, r.parking)
			if work != 0 || parked != 0 || r.init.calls.Load() != 1 {
				t.Fatalf("watermill-amqp's publisher: %d park(s), %d on the work queue, %d on the parking queue: "+
					"the copy was not lost as docs/poison.md says", r.init.calls.Load(), work, parked)
			}
			t.Logf("lost: the original acked after one park, nothing on the work or parking queue")
		})
	}
}

// The same through the pipeline, for a dead letter, with watermill-amqp's
// Subscriber consuming and declaring the parking topic (the pipeline's
// default initializer, wrapped here to delete the queue after each
// declaration): amqpsub's Publisher as Config.Publisher makes the unrouted
// copy a failed park, the original comes back without another run, and the
// copy lands once the queue stays.
func TestPipelineDeadLetterThroughAmqpsubPublisher(t *testing.T) {
	t.Parallel()
	f := newPubFixture(t)
	work := testenv.Name(t, "w")
	dead := work + ".dead_letter"
	f.queue(t, work)
	f.cleanup(t, func(ch *amqp091.Channel) { _, _ = ch.QueueDelete(dead, false, false, false) })
	cfg := f.config(t)
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, nil)
	must(t, err)
	init := &breakingInitializer{sub: sub, after: func(topic string) { parkScenarios[0].breakRoute(t, f, topic) }}
	init.broken.Store(true)
	log := &countingLog{}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: pub, ParkInitializer: init, NackDelay: 50 * time.Millisecond, Logger: log, DisableTracing: true,
		Retry: middleware.RetryConfig{MaxAttempts: 1, NoInProcessRetries: true, RedeliveryDelay: settle.NoDelay},
	})
	must(t, err)
	var runs atomic.Int64
	_, err = p.Handle("h", work, sub, func(*message.Message) error {
		runs.Add(1)
		return errors.New("the card service is down")
	})
	must(t, err)
	ch, err := f.conn.Channel()
	must(t, err)
	must(t, ch.PublishWithContext(t.Context(), "", work, false, false, amqp091.Publishing{
		MessageId: "payment-9", DeliveryMode: amqp091.Persistent, Body: []byte(`{}`),
	}))
	_ = ch.Close()

	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- router.Run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		must(t, router.Close())
		must(t, <-errc)
		must(t, sub.Close())
		must(t, pub.Close())
	}
	defer stop()
	<-router.Running()

	count := func(queue string) int {
		ch, err := f.conn.Channel()
		must(t, err)
		defer ch.Close()
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return 0
		}
		return q.Messages
	}
	if !waitFor(func() bool { return init.calls.Load() >= 4 }) {
		t.Fatalf("%d park(s) within 60s, want 4: the original was acked after a copy routed to no queue (%d on %s, %d on %s)",
			init.calls.Load(), count(work), work, count(dead), dead)
	}
	init.broken.Store(false)
	if !waitFor(func() bool { return count(dead) == 1 && log.parked() }) {
		t.Fatalf("the copy is not on %s 60s after the queue was left in place (%d there)", dead, count(dead))
	}
	time.Sleep(200 * time.Millisecond) // the router acks the original after the middleware returned
	stop()
	if n := count(work); n != 0 {
		t.Errorf("%d message(s) on the work queue after the copy was parked, want 0", n)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the handler ran %d times, want 1 (MaxAttempts 1; a deferred park runs nothing again)", n)
	}
	got := f.drain(t, dead)
	if len(got) != 1 || got["payment-9"] != 1 {
		t.Errorf("%s holds %v, want payment-9 once", dead, got)
	}
}
