package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric/noop"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/otlptest"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
)

// On a router assembled by hand whose handlers return messages for the router
// itself to publish, a service that closes the router and shuts its tracer
// provider down right after loses no settle span: with
// middleware.TracePublished among the router's publisher decorators, each
// settle span ends when the router's publish of the delivery's output
// returns, on the delivery's goroutine, before the router acks or nacks, so
// before router.Close returns.
//
// Each round closes a router with deliveries in flight (some failing once,
// so nacked; some whose publish fails, so nacked by the router after the
// middleware decided ack) and shuts the provider down at once. What is
// checked is every delivery the router had acked or nacked when Close
// returned (Watermill's Close can return with a delivery it started late
// still running; that one is not settled yet): each has its settle span at
// the exporter, and it names what the router did.
func TestNoRouterPublishedSettleSpanLostAtShutdown(t *testing.T) {
	t.Parallel()
	const rounds = 25
	t.Run("exporter", func(t *testing.T) {
		t.Parallel()
		for r := range rounds {
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(keep{exp}, sdktrace.WithBatchTimeout(time.Hour)))
			settled := routerPublishesThenShutdown(t, tp, fmt.Sprintf("r%02d", r), nil, false)
			got := map[string][]string{}
			for _, s := range exp.GetSpans() {
				if strings.HasPrefix(s.Name, "ack ") || strings.HasPrefix(s.Name, "nack ") {
					var id, decision string
					for _, a := range s.Attributes {
						switch a.Key {
						case "messaging.message.id":
							id = a.Value.AsString()
						case "settle.router_decision":
							decision = a.Value.AsString()
						}
					}
					got[id] = append(got[id], routerDid(s.Name, decision))
				}
			}
			checkRouterSettled(t, r, settled, got, "exporter")
		}
	})
	t.Run("otlp", func(t *testing.T) {
		t.Parallel()
		recv := otlptest.New(t)
		for r := range rounds {
			settled := routerPublishesThenShutdown(t, recv.TracerProvider(t), fmt.Sprintf("o%02d", r), nil, false)
			got := map[string][]string{}
			for _, s := range recv.Spans() {
				if op, _ := otlptest.Attr(s, "messaging.operation.type"); op == "settle" {
					id, _ := otlptest.Attr(s, "messaging.message.id")
					if strings.HasPrefix(id, fmt.Sprintf("o%02d-", r)) {
						decision, _ := otlptest.Attr(s, "settle.router_decision")
						got[id] = append(got[id], routerDid(s.Name, decision))
					}
				}
			}
			checkRouterSettled(t, r, settled, got, "receiver")
		}
	})
}

// The same with the router publishing to RabbitMQ: a publish that waits on
// the network, so the router acks later after the chain returned.
func TestNoRouterPublishedSettleSpanLostAtShutdownAMQP(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	cfg := amqp.NewDurableQueueConfig(url)
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	prefix := testenv.Name(t, "span_out")
	for r := range 8 {
		exp := tracetest.NewInMemoryExporter()
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(keep{exp}, sdktrace.WithBatchTimeout(time.Hour)))
		settled := routerPublishesThenShutdown(t, tp, fmt.Sprintf("a%02d", r), &amqpOut{pub: pub, prefix: prefix}, false)
		got := map[string][]string{}
		for _, s := range exp.GetSpans() {
			if strings.HasPrefix(s.Name, "ack ") || strings.HasPrefix(s.Name, "nack ") {
				var id, decision string
				for _, a := range s.Attributes {
					switch a.Key {
					case "messaging.message.id":
						id = a.Value.AsString()
					case "settle.router_decision":
						decision = a.Value.AsString()
					}
				}
				got[id] = append(got[id], routerDid(s.Name, decision))
			}
		}
		checkRouterSettled(t, r, settled, got, "exporter")
	}
}

// amqpOut is the router's publisher of the AMQP case: it publishes to
// RabbitMQ under the test's own queue names, and never closes the shared
// publisher (the router closes each handler's publisher).
type amqpOut struct {
	pub    message.Publisher
	prefix string
}

func (o *amqpOut) Publish(topic string, msgs ...*message.Message) error {
	return o.pub.Publish(o.prefix+"_"+topic, msgs...)
}

func (*amqpOut) Close() error { return nil }

// unclosed is a publisher whose Close leaves it open.
type unclosed struct{ message.Publisher }

func (unclosed) Close() error { return nil }

// routerDid is what a settle span says the router did: its name, unless
// settle.router_decision says otherwise.
func routerDid(name, decision string) string {
	if decision != "" {
		return decision
	}
	op, _, _ := strings.Cut(name, " ")
	return op
}

// checkRouterSettled checks that each settlement the router made before the
// shutdown (message ID -> "ack"/"nack", one per delivery) has a settle span
// saying so.
func checkRouterSettled(t *testing.T, round int, settled map[string][]string, got map[string][]string, where string) {
	t.Helper()
	lost, wrong, n := 0, 0, 0
	for id, did := range settled {
		have := got[id]
		for _, d := range did {
			n++
			i := indexOf(have, d)
			switch {
			case i >= 0:
				have = append(have[:i], have[i+1:]...)
			case len(have) > 0:
				wrong++
				have = have[1:]
			default:
				lost++
			}
		}
	}
	if lost > 0 || wrong > 0 {
		t.Errorf("round %d: of the %d settlements the router made before the shutdown, %d have no settle span at the %s, %d one naming another settlement", round, n, lost, where, wrong)
	}
	if n < 40 {
		t.Errorf("round %d: only %d settlements before the shutdown; the test wants more in flight", round, n)
	}
}

func indexOf(s []string, v string) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// failsOnce is a router publisher that fails the first publish of each
// output whose ID says so, then publishes through pub.
type failsOnce struct {
	message.Publisher
	failed sync.Map
}

var errPublishOnce = errors.New("publish fails once")

func (p *failsOnce) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if strings.Contains(m.UUID, "-pubfail-") {
			if _, again := p.failed.LoadOrStore(m.UUID, struct{}{}); !again {
				return errPublishOnce
			}
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// routerPublishesThenShutdown runs a hand-built router whose handlers return
// their output for the router to publish (to the in-process pubsub, or to
// out), with the tracing middleware on tp, closes it while deliveries are in
// flight, then shuts tp down at once. checkGoroutines checks that no
// goroutine of the tracing middleware is left when Close returns (only
// from a test that runs alone: the check sees every test's goroutines). It returns what the router had done
// with each delivery when Close returned: message ID -> "ack" or "nack", one
// entry per delivery.
func routerPublishesThenShutdown(t *testing.T, tp *sdktrace.TracerProvider, prefix string, out message.Publisher, checkGoroutines bool) map[string][]string {
	t.Helper()
	mw, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMeterProvider(noop.NewMeterProvider()))
	must(t, err)
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer func() { _ = pubsub.Close() }()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	must(t, err)
	router.AddPublisherDecorators(middleware.TracePublished)
	var (
		mu         sync.Mutex
		deliveries []*message.Message
	)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			deliveries = append(deliveries, msg)
			mu.Unlock()
			return h(msg)
		}
	}, mw)

	const handlers, perHandler = 6, 40
	var (
		runs   atomic.Int64
		failed sync.Map // UUID -> struct{}: failed once already
	)
	errOnce := errors.New("fails once")
	if out == nil {
		// The output goes to a pubsub of its own that the test closes: the
		// router closes each handler's subscriber, and its publisher, while
		// deliveries it started late may still publish.
		outs := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		defer func() { _ = outs.Close() }()
		out = unclosed{outs}
	}
	for h := range handlers {
		topic := fmt.Sprintf("%s-in-%d", prefix, h)
		router.AddHandler(topic, topic, pubsub, "out-"+topic, &failsOnce{Publisher: out}, func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			time.Sleep(time.Millisecond)
			if msg.Metadata.Get("fail") != "" {
				if _, again := failed.LoadOrStore(msg.UUID, struct{}{}); !again {
					return nil, errOnce
				}
			}
			return []*message.Message{message.NewMessage(msg.Metadata.Get("out")+"-"+watermill.NewShortUUID(), nil)}, nil
		})
		for i := range perHandler {
			m := message.NewMessage(fmt.Sprintf("%s-%03d", topic, i), nil)
			m.Metadata.Set("out", "x")
			switch i % 5 {
			case 1:
				m.Metadata.Set("fail", "1")
			case 2:
				m.Metadata.Set("out", "x-pubfail")
			}
			must(t, pubsub.Publish(topic, m))
		}
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	eventually(t, 10*time.Second, "handler runs", func() bool { return runs.Load() >= handlers*perHandler/3 })
	must(t, router.Close())
	if checkGoroutines {
		if n := goroutinesIn("middleware.(*pending).await"); n > 0 {
			t.Errorf("%d goroutines waiting for a settlement when router.Close returned", n)
		}
	}
	settled := map[string][]string{}
	mu.Lock()
	for _, m := range deliveries {
		select {
		case <-m.Acked():
			settled[m.UUID] = append(settled[m.UUID], "ack")
		case <-m.Nacked():
			settled[m.UUID] = append(settled[m.UUID], "nack")
		default: // started after Close stopped waiting
		}
	}
	mu.Unlock()
	must(t, tp.Shutdown(context.Background())) // what a service does right after
	must(t, <-done)
	// Deliveries the router started late may still be publishing: wait for
	// them before the test closes the publisher they use.
	eventually(t, 10*time.Second, "late deliveries", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range deliveries {
			select {
			case <-m.Acked():
			case <-m.Nacked():
			default:
				return false
			}
		}
		return true
	})
	return settled
}

// No goroutine of the tracing middleware outlives router.Close on a router
// with TracePublished: a handler's first deliveries start one to wait for
// the router's ack (TracePublished may be missing), and TracePublished waits
// for it to return before the router acks. Not parallel: it counts the
// goroutines of the whole test binary.
func TestNoSettleGoroutineOutlivesClose(t *testing.T) {
	for r := range 10 {
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(keep{tracetest.NewInMemoryExporter()}))
		routerPublishesThenShutdown(t, tp, fmt.Sprintf("g%02d", r), nil, true)
	}
}

// goroutinesIn counts the goroutines with fn on their stack.
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), fn+"(")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// errorHandler is an OpenTelemetry error handler that keeps what it is
// given.
type errorHandler struct {
	mu   sync.Mutex
	errs []error
}

func (h *errorHandler) Handle(err error) {
	h.mu.Lock()
	h.errs = append(h.errs, err)
	h.mu.Unlock()
}

func (h *errorHandler) got() []error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]error(nil), h.errs...)
}

// A router whose handler returns output for the router to publish, without
// TracePublished among its publisher decorators, is reported to the
// OpenTelemetry error handler, once per tracing middleware however many
// deliveries, naming the handler and the line to add; with it, nothing is
// reported. Not parallel: it sets the global error handler.
func TestMissingTracePublishedIsReported(t *testing.T) {
	prev := otel.GetErrorHandler()
	h := &errorHandler{}
	otel.SetErrorHandler(h)
	t.Cleanup(func() { otel.SetErrorHandler(prev) })
	for _, decorated := range []bool{false, true} {
		h.mu.Lock()
		h.errs = nil
		h.mu.Unlock()
		tr := newTraced(t)
		ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
		must(t, err)
		if decorated {
			router.AddPublisherDecorators(middleware.TracePublished)
		}
		router.AddHandler("orders", "in", ps, "out", ps, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
		}).AddMiddleware(tr.mw)
		const n = 20
		for i := range n {
			must(t, ps.Publish("in", message.NewMessage(fmt.Sprintf("m-%02d", i), nil)))
		}
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		eventually(t, 10*time.Second, "settle spans", func() bool {
			c := 0
			for _, s := range tr.rec.Ended() {
				if s.Name() == "ack in" {
					c++
				}
			}
			return c == n
		})
		must(t, router.Close())
		must(t, <-done)
		must(t, ps.Close())
		errs := h.got()
		switch {
		case decorated && len(errs) != 0:
			t.Errorf("with TracePublished: %d errors reported, want none: %v", len(errs), errs)
		case !decorated && len(errs) != 1:
			t.Errorf("without TracePublished: %d errors reported, want 1: %v", len(errs), errs)
		case !decorated && (!strings.Contains(errs[0].Error(), `"orders"`) || !strings.Contains(errs[0].Error(), "router.AddPublisherDecorators(middleware.TracePublished)")):
			t.Errorf("without TracePublished, reported %q; want the handler and the line to add", errs[0])
		}
	}
}

// panicking is a router publisher that panics on its first publish.
type panicking struct {
	message.Publisher
	once sync.Once
}

func (p *panicking) Publish(topic string, msgs ...*message.Message) error {
	p.once.Do(func() { panic("publisher bug") })
	return p.Publisher.Publish(topic, msgs...)
}

// A publish that panics: the router recovers and nacks, and the settle span,
// ended by TracePublished as the panic goes through it, says so.
func TestTracePublishedPanickingPublish(t *testing.T) {
	t.Parallel()
	tr := newTraced(t)
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	router.AddPublisherDecorators(middleware.TracePublished)
	router.AddHandler("h", "in", ps, "out", &panicking{Publisher: ps}, func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
	}).AddMiddleware(tr.mw)
	must(t, ps.Publish("in", message.NewMessage("m-1", nil)))
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	spans := tr.spans(t, 4) // process and settle, twice (the redelivery)
	must(t, router.Close())
	must(t, <-done)
	must(t, ps.Close())
	var decisions []string
	for _, s := range spans {
		if attr(s, "messaging.operation.type").AsString() == "settle" {
			decisions = append(decisions, routerDid(s.Name(), attr(s, "settle.router_decision").AsString()))
			if d := attr(s, "settle.router_decision").AsString(); d == "nack" && s.Status().Code != codes.Error {
				t.Errorf("the nack after a panicking publish: status %v, want an error", s.Status())
			}
		}
	}
	if len(decisions) < 2 || decisions[0] != "nack" || decisions[1] != "ack" {
		t.Errorf("settle spans say the router did %v, want nack (the panic), then ack", decisions)
	}
}
