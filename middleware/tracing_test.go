package middleware_test

import (
	"context"
	"errors"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

type traced struct {
	rec    *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
	mw     message.HandlerMiddleware
}

func newTraced(t *testing.T, opts ...settle.Option) *traced {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) })
	opts = append([]settle.Option{
		settle.WithTracerProvider(tp), settle.WithMeterProvider(mp),
		settle.WithPropagators(propagation.TraceContext{}), settle.WithMessagingSystem("gochannel"),
	}, opts...)
	mw, err := middleware.NewTracing(opts...)
	must(t, err)
	return &traced{rec: rec, tp: tp, reader: reader, mw: mw}
}

func (tr *traced) spans(t *testing.T, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	eventually(t, 5*time.Second, "ended spans", func() bool { return len(tr.rec.Ended()) >= n })
	return tr.rec.Ended()
}

func byName(spans []sdktrace.ReadOnlySpan, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// The outcomes on a real GoChannel router with the whole stack.
func TestTracingOutcomes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		handler    func(*message.Message) error
		publish    int // copies of the same message
		outcome    settle.Outcome
		statusErr  bool
		settleOp   string
		wantParked string
	}{
		{"done", func(*message.Message) error { return nil }, 1, settle.Done, false, "ack", ""},
		{"dead_lettered", func(*message.Message) error { return errFlaky }, 1, settle.DeadLettered, true, "ack", deadTopic},
		{"poisoned", func(*message.Message) error { return poison.Permanent(errors.New("bad currency")) }, 1, settle.Poisoned, true, "ack", poisonTopic},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			tr := newTraced(t)
			s := newStack(t, stackOpts{retry: fastRetry(2, 0), outer: tr.mw}, c.handler)
			s.publish(message.NewMessage(watermill.NewUUID(), []byte("{}")))
			s.waitAcked(1)
			// The process span ends just after the chain returns: wait for
			// the one with the expected outcome.
			var last sdktrace.ReadOnlySpan
			eventually(t, 5*time.Second, "the process span of the last delivery", func() bool {
				for _, sp := range byName(tr.rec.Ended(), "process "+topic) {
					if attr(sp, attribute.Key("settle.outcome")).AsString() == string(c.outcome) {
						last = sp
						return true
					}
				}
				return false
			})
			if last.SpanKind() != trace.SpanKindConsumer {
				t.Fatalf("process span kind %v", last.SpanKind())
			}
			if got := attr(last, attribute.Key("settle.outcome")).AsString(); got != string(c.outcome) {
				t.Fatalf("outcome %q, want %q", got, c.outcome)
			}
			for k, want := range map[attribute.Key]string{
				"messaging.system": "gochannel", "messaging.destination.name": topic,
				"messaging.operation.type": "process", "settle.handler": handlerName,
			} {
				if got := attr(last, k).AsString(); got != want {
					t.Errorf("%s = %q, want %q", k, got, want)
				}
			}
			if (last.Status().Code == codes.Error) != c.statusErr {
				t.Errorf("status %v, want error=%v", last.Status(), c.statusErr)
			}
			// The process span ends at the settlement and records it; a
			// nack has a settle span of its own under it, a plain ack none.
			if got := attr(last, settledKey).AsString(); got != c.settleOp {
				t.Fatalf("process span settle.settled = %q, want %q", got, c.settleOp)
			}
			spans := tr.rec.Ended()
			if c.settleOp == "ack" {
				n := 0
				for _, st := range append(byName(spans, "ack "+topic), byName(spans, "nack "+topic)...) {
					if st.Parent().SpanID() == last.SpanContext().SpanID() {
						n++
					}
				}
				if n != 0 {
					t.Fatalf("%d settle spans for a plain ack, want none: the process span tells it", n)
				}
			} else {
				settles := byName(spans, "nack "+topic)
				if len(settles) == 0 {
					t.Fatalf("no %q span among %d", "nack "+topic, len(spans))
				}
				st := settles[len(settles)-1]
				if st.SpanKind() != trace.SpanKindClient || attr(st, "messaging.operation.type").AsString() != "settle" ||
					st.Parent().SpanID() != last.SpanContext().SpanID() {
					t.Fatalf("settle span kind=%v op=%q parent=%v; want a client settle span under the process span",
						st.SpanKind(), attr(st, "messaging.operation.type").AsString(), st.Parent().SpanID())
				}
			}
			checkIdentified(t, spans, "gochannel")
			if c.wantParked != "" {
				sends := byName(spans, "send "+c.wantParked)
				if len(sends) != 1 || sends[0].SpanKind() != trace.SpanKindProducer || sends[0].Parent().SpanID() != last.SpanContext().SpanID() {
					t.Fatalf("want one producer span %q under the process span, got %d", "send "+c.wantParked, len(sends))
				}
				eventually(t, 5*time.Second, "the parked copy", func() bool { _, d, p := s.snapshot(); return len(d)+len(p) == 1 })
				_, dead, pois := s.snapshot()
				copies := append(dead, pois...)
				sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(copies[0].Metadata)))
				if sc.TraceID() != last.SpanContext().TraceID() || sc.SpanID() != sends[0].SpanContext().SpanID() {
					t.Fatalf("the parked copy carries trace %s span %s; want the send span of trace %s", sc.TraceID(), sc.SpanID(), last.SpanContext().TraceID())
				}
			}
		})
	}
}

func TestTracingRetryAndDuplicate(t *testing.T) {
	t.Parallel()
	tr := newTraced(t)
	s := newStack(t, stackOpts{retry: fastRetry(5, 0), outer: tr.mw}, failing(1, errFlaky))
	uuid := watermill.NewUUID()
	s.publish(message.NewMessage(uuid, nil))
	s.waitAcked(1)
	s.publish(message.NewMessage(uuid, nil)) // a redelivery after success
	s.waitAcked(2)
	eventually(t, 5*time.Second, "settlements", func() bool { return len(byName(tr.rec.Ended(), "process "+topic)) == 3 })
	spans := tr.spans(t, 4)
	procs := byName(spans, "process "+topic)
	sort.Slice(procs, func(i, j int) bool { return procs[i].StartTime().Before(procs[j].StartTime()) })
	var outcomes []string
	for _, p := range procs {
		outcomes = append(outcomes, attr(p, attribute.Key("settle.outcome")).AsString())
		if o := attr(p, attribute.Key("settle.outcome")).AsString(); o == "retry" && p.Status().Code != codes.Error {
			t.Errorf("a retry's process span has status %v", p.Status())
		} else if o == "duplicate" && p.Status().Code == codes.Error {
			t.Errorf("a duplicate is not an error: %v", p.Status())
		}
	}
	if len(outcomes) != 3 || outcomes[0] != "retry" || outcomes[1] != "done" || outcomes[2] != "duplicate" {
		t.Fatalf("outcomes %v, want [retry done duplicate]", outcomes)
	}
	if n := len(byName(spans, "nack "+topic)); n != 1 {
		t.Fatalf("%d nack spans, want 1", n)
	}
	if n := len(byName(spans, "ack "+topic)); n != 0 {
		t.Fatalf("%d ack spans, want none: a plain ack is told by its process span", n)
	}
	var settled []string
	for _, p := range procs {
		settled = append(settled, attr(p, settledKey).AsString())
	}
	if strings.Join(settled, " ") != "nack ack ack" {
		t.Fatalf("process spans settle.settled %v, want [nack ack ack]", settled)
	}
	var rm metricdata.ResourceMetrics
	must(t, tr.reader.Collect(t.Context(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "settle.settlements" {
				for _, dp := range d.DataPoints {
					o, _ := dp.Attributes.Value(attribute.Key("settle.outcome"))
					got[o.AsString()] += dp.Value
				}
			}
		}
	}
	if got["retry"] != 1 || got["done"] != 1 || got["duplicate"] != 1 {
		t.Fatalf("settle.settlements = %v, want one each of retry, done, duplicate", got)
	}
}

// A delivery that leaves the router nothing to publish ends its settle span
// before the middleware returns, on its own goroutine, named for what the
// router then does: ack a success, nack an error, nack a success with output
// but no publisher (Watermill's ErrOutputInNoPublisherHandler).
func TestSettleSpanEndsBeforeTheMiddlewareReturns(t *testing.T) {
	t.Parallel()
	errFail := errors.New("fail")
	for _, c := range []struct {
		name           string
		out            []*message.Message
		err            error
		want, decision string
	}{
		{"success", nil, nil, "ack", ""},
		{"error", nil, errFail, "nack", ""},
		{"output without a publisher", []*message.Message{message.NewMessage("out", nil)}, nil, "ack", "nack"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			tr := newTraced(t)
			h := tr.mw(func(*message.Message) ([]*message.Message, error) { return c.out, c.err })
			_, _ = h(message.NewMessage("m-1", nil))
			got := tr.rec.Ended()
			// A plain ack: the process span alone. A nack: its settle
			// span, then the process span, which ends at the settlement.
			var proc, settle sdktrace.ReadOnlySpan
			switch {
			case c.want == "ack" && c.decision == "" && len(got) == 1 && got[0].Name() == "process":
				proc = got[0]
			case len(got) == 2 && got[0].Name() == "nack" && got[1].Name() == "process":
				settle, proc = got[0], got[1]
			default:
				t.Fatalf("when the middleware returned, %d spans had ended; want the process span (and a nack span before it for a nack)", len(got))
			}
			want := c.want
			if c.decision != "" {
				want = c.decision
			}
			if s := attr(proc, settledKey).AsString(); s != want {
				t.Errorf("settle.settled %q, want %q", s, want)
			}
			if settle == nil {
				return
			}
			if d := attr(settle, "settle.router_decision").AsString(); d != c.decision {
				t.Errorf("settle.router_decision %q, want %q", d, c.decision)
			}
			if c.decision == "nack" && settle.Status().Code != codes.Error {
				t.Errorf("a success the router nacks: settle span status %v, want an error", settle.Status())
			}
		})
	}
}

// gatedPublisher is a router's publisher that publishes nothing: each
// Publish waits for a release, which says whether it fails.
type gatedPublisher struct {
	entered chan string // the UUID of the first message of each Publish
	release chan error
}

func (p *gatedPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.entered <- msgs[0].UUID
	return <-p.release
}

func (p *gatedPublisher) Close() error { return nil }

// When the router publishes a delivery's output after the chain returned,
// the settle span waits for the router's settlement: it ends only once the
// router has published, and when publishing fails and the router nacks
// instead, it says so in settle.router_decision, with error status. One
// never settled within the settle wait ends with an error, once. With
// TracePublished among the router's publisher decorators, the span has
// ended when the router's publish returns, before the router acks or nacks:
// a decorator the test adds outermost sees it ended.
func TestSettleSpanWaitsForTheRoutersPublish(t *testing.T) {
	t.Parallel()
	for _, decorated := range []bool{false, true} {
		t.Run(map[bool]string{false: "alone", true: "TracePublished"}[decorated], func(t *testing.T) {
			t.Parallel()
			settleSpanWaitsForTheRoutersPublish(t, decorated)
		})
	}
}

func settleSpanWaitsForTheRoutersPublish(t *testing.T, decorated bool) {
	tr := newTraced(t, settle.WithSettleWait(time.Second))
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	pub := &gatedPublisher{entered: make(chan string), release: make(chan error)}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	must(t, err)
	settleSpans := func() []sdktrace.ReadOnlySpan {
		var out []sdktrace.ReadOnlySpan
		for _, s := range tr.rec.Ended() {
			if attr(s, "messaging.operation.type").AsString() == "settle" {
				out = append(out, s)
			}
		}
		return out
	}
	// endedAtReturn: the settle spans ended when each router publish
	// returned, as the outermost publisher decorator saw.
	endedAtReturn := make(chan int, 10)
	if decorated {
		router.AddPublisherDecorators(func(pub message.Publisher) (message.Publisher, error) {
			return publishFunc{pub, func(topic string, msgs ...*message.Message) error {
				err := pub.Publish(topic, msgs...)
				endedAtReturn <- len(settleSpans())
				return err
			}}, nil
		}, middleware.TracePublished)
	}
	router.AddHandler("h", "in", ps, "out", pub, func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("out-of-"+msg.UUID, nil)}, nil
	}).AddMiddleware(tr.mw)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
		must(t, ps.Close())
	})
	step := func(n int, release error, wait time.Duration) sdktrace.ReadOnlySpan {
		t.Helper()
		select {
		case <-pub.entered:
		case <-time.After(5 * time.Second):
			t.Fatal("the router did not publish the output")
		}
		time.Sleep(wait) // give a wrongly eager settle span the chance to end
		if got := len(settleSpans()); got != n-1 && wait < time.Second {
			t.Fatalf("%d settle spans ended while the router was publishing, want %d", got, n-1)
		}
		pub.release <- release
		if decorated {
			if got := <-endedAtReturn; got != n {
				t.Fatalf("%d settle spans had ended when the router's publish returned, want %d", got, n)
			}
		}
		eventually(t, 5*time.Second, "the settle span", func() bool { return len(settleSpans()) >= n })
		s := settleSpans()[n-1]
		// The process span stays open until the settlement, so it ends
		// with (just after) its ack span, and records what the router did.
		var proc sdktrace.ReadOnlySpan
		for _, p := range byName(tr.rec.Ended(), "process in") {
			if p.SpanContext().SpanID() == s.Parent().SpanID() {
				proc = p
			}
		}
		if proc == nil {
			t.Fatalf("settle span %d: its process span has not ended with it", n)
		}
		if proc.EndTime().Before(s.EndTime()) {
			t.Errorf("settle span %d: the process span ended %v before it, want at the settlement", n, s.EndTime().Sub(proc.EndTime()))
		}
		want := "ack"
		if release != nil {
			want = "nack"
		}
		if got := attr(proc, settledKey).AsString(); got != want && wait < time.Second {
			t.Errorf("settle span %d: process span settle.settled %q, want %q", n, got, want)
		}
		return s
	}

	must(t, ps.Publish("in", message.NewMessage("m-1", nil)))
	// Publishing fails: the router nacks what the middleware settled as ack.
	s := step(1, errors.New("broker down"), 30*time.Millisecond)
	if s.Name() != "ack in" || attr(s, "settle.router_decision").AsString() != "nack" || s.Status().Code != codes.Error {
		t.Errorf("after a failed publish: %q, router decision %q, status %v; want ack in, nack, error", s.Name(), attr(s, "settle.router_decision").AsString(), s.Status())
	}
	// The redelivery's output is published: the router acks as decided.
	s = step(2, nil, 30*time.Millisecond)
	if s.Name() != "ack in" || attr(s, "settle.router_decision").AsString() != "" || s.Status().Code == codes.Error {
		t.Errorf("after a publish: %q, router decision %q, status %v; want ack in as decided", s.Name(), attr(s, "settle.router_decision").AsString(), s.Status())
	}
	// A publish that outlasts the settle wait.
	must(t, ps.Publish("in", message.NewMessage("m-2", nil)))
	start := time.Now()
	s = step(3, nil, 1100*time.Millisecond)
	if took := s.EndTime().Sub(start); took < time.Second {
		t.Errorf("the settle span ended after %v, before the settle wait", took)
	}
	if s.Status().Code != codes.Error || s.Status().Description != "not acked or nacked within 1s" {
		t.Errorf("settle span status %v; want an error saying it was not settled within 1s", s.Status())
	}
	time.Sleep(30 * time.Millisecond)
	if n := len(settleSpans()); n != 3 {
		t.Errorf("%d settle spans after the late ack, want 3", n)
	}
}

// publishFunc is a publisher whose Publish is a function.
type publishFunc struct {
	message.Publisher
	publish func(topic string, msgs ...*message.Message) error
}

func (p publishFunc) Publish(topic string, msgs ...*message.Message) error {
	return p.publish(topic, msgs...)
}

func TestProducerContextIsParentOrLink(t *testing.T) {
	t.Parallel()
	producerTP := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = producerTP.Shutdown(context.Background()) })
	ctx, producer := producerTP.Tracer("producer").Start(context.Background(), "send orders")
	producer.End()
	newMsg := func() *message.Message {
		m := message.NewMessage(watermill.NewUUID(), nil)
		propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(m.Metadata))
		return m
	}
	run := func(tr *traced) sdktrace.ReadOnlySpan {
		h := tr.mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		m := newMsg()
		if _, err := h(m); err != nil {
			t.Fatal(err)
		}
		m.Ack()
		return tr.spans(t, 1)[0]
	}
	parent := run(newTraced(t))
	if parent.Parent().SpanID() != producer.SpanContext().SpanID() || parent.SpanContext().TraceID() != producer.SpanContext().TraceID() {
		t.Fatalf("default: the process span's parent is %v, want the producer span", parent.Parent().SpanID())
	}
	linked := run(newTraced(t, settle.WithLinkToProducer()))
	if linked.Parent().IsValid() || len(linked.Links()) != 1 || linked.Links()[0].SpanContext.SpanID() != producer.SpanContext().SpanID() {
		t.Fatalf("with a link: parent %v, links %v; want a new root linked to the producer", linked.Parent(), linked.Links())
	}
}

// A deferral (the key is held by another delivery) is nacked but is not an
// error: the process span has no error status.
func TestTracingDeferred(t *testing.T) {
	t.Parallel()
	tr := newTraced(t)
	release := make(chan struct{})
	var first atomic.Bool
	s := newStack(t, stackOpts{retry: fastRetry(3, 0), outer: tr.mw}, func(*message.Message) error {
		if first.CompareAndSwap(false, true) {
			<-release
		}
		return nil
	})
	uuid := watermill.NewUUID()
	s.publish(message.NewMessage(uuid, nil), message.NewMessage(uuid, nil))
	eventually(t, 5*time.Second, "a deferred delivery", func() bool {
		for _, sp := range byName(tr.rec.Ended(), "process "+topic) {
			if attr(sp, attribute.Key("settle.outcome")).AsString() == "deferred" {
				return true
			}
		}
		return false
	})
	close(release)
	s.waitAcked(2)
	for _, sp := range byName(tr.rec.Ended(), "process "+topic) {
		if attr(sp, attribute.Key("settle.outcome")).AsString() == "deferred" && sp.Status().Code == codes.Error {
			t.Fatalf("a deferral has error status: %v", sp.Status())
		}
	}
	eventually(t, 5*time.Second, "a nack span for the deferral", func() bool { return len(byName(tr.rec.Ended(), "nack "+topic)) > 0 })
}

// checkIdentified fails unless every span has the attributes that identify
// the delivery it belongs to.
func checkIdentified(t *testing.T, spans []sdktrace.ReadOnlySpan, system string) {
	t.Helper()
	for _, s := range spans {
		if got := attr(s, "messaging.system").AsString(); got != system {
			t.Errorf("span %q: messaging.system = %q, want %q", s.Name(), got, system)
		}
		for _, k := range []attribute.Key{"messaging.destination.name", "messaging.message.id", attribute.Key("settle.handler")} {
			if attr(s, k).AsString() == "" {
				t.Errorf("span %q has no %s", s.Name(), k)
			}
		}
	}
}

// A handler's output continues the handler's trace through a real router:
// the consumer of a produced message processes it under the producer's
// create span, which is under the producing delivery's process span. Both
// ways the output is published are covered: by the router after the
// middleware returned, and by the dedupe middleware inside the chain (with
// TraceProduced innermost).
func TestProducedMessagesContinueTheTrace(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		dedupePublish bool
	}{{"router publishes", false}, {"dedupe publishes", true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			tr := newTraced(t)
			logger := watermill.NopLogger{}
			ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, logger)
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
			must(t, err)
			in := router.AddHandler("in", "in", ps, "mid", ps, func(msg *message.Message) ([]*message.Message, error) {
				// The output is made without the delivery's context, as
				// handlers usually make it.
				return []*message.Message{message.NewMessage("out-of-"+msg.UUID, nil)}, nil
			})
			in.AddMiddleware(tr.mw)
			if c.dedupePublish {
				dd, err := dedupe.NewMiddleware(dedupe.Config{Store: dedupe.NewMemoryStore(), Publisher: ps})
				must(t, err)
				in.AddMiddleware(dd, middleware.TraceProduced)
			}
			var consumed atomic.Int64
			router.AddConsumerHandler("mid", "mid", ps, func(*message.Message) error {
				consumed.Add(1)
				return nil
			}).AddMiddleware(tr.mw)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			t.Cleanup(func() {
				must(t, router.Close())
				must(t, <-done)
				must(t, ps.Close())
			})
			must(t, ps.Publish("in", message.NewMessage("m-1", nil)))
			eventually(t, 5*time.Second, "both deliveries acked", func() bool {
				return len(byName(tr.rec.Ended(), "process in")) == 1 && len(byName(tr.rec.Ended(), "process mid")) == 1
			})
			spans := tr.rec.Ended()
			one := func(name string) sdktrace.ReadOnlySpan {
				t.Helper()
				got := byName(spans, name)
				if len(got) != 1 {
					var names []string
					for _, s := range spans {
						names = append(names, s.Name())
					}
					t.Fatalf("%d spans %q, want 1; spans: %v", len(got), name, names)
				}
				return got[0]
			}
			procIn, create, procMid := one("process in"), one("create mid"), one("process mid")
			if create.SpanKind() != trace.SpanKindProducer || attr(create, "messaging.operation.type").AsString() != "create" ||
				attr(create, "messaging.message.id").AsString() != "out-of-m-1" || attr(create, "messaging.destination.name").AsString() != "mid" {
				t.Errorf("create span: kind %v, attributes %v", create.SpanKind(), create.Attributes())
			}
			if create.Parent().SpanID() != procIn.SpanContext().SpanID() {
				t.Errorf("the create span's parent is %v, want the producing process span %v", create.Parent().SpanID(), procIn.SpanContext().SpanID())
			}
			if procMid.SpanContext().TraceID() != procIn.SpanContext().TraceID() || procMid.Parent().SpanID() != create.SpanContext().SpanID() {
				t.Errorf("process mid: trace %s parent %s; want trace %s under the create span %s",
					procMid.SpanContext().TraceID(), procMid.Parent().SpanID(), procIn.SpanContext().TraceID(), create.SpanContext().SpanID())
			}
			checkIdentified(t, spans, "gochannel")
			if attr(procMid, attribute.Key("settle.handler")).AsString() != "mid" || attr(create, attribute.Key("settle.handler")).AsString() != "in" {
				t.Errorf("settle.handler: process mid %q, create %q", attr(procMid, attribute.Key("settle.handler")).AsString(), attr(create, attribute.Key("settle.handler")).AsString())
			}
		})
	}
}

// Without the tracing middleware outside it, TraceProduced leaves the
// output alone.
func TestTraceProducedAloneDoesNothing(t *testing.T) {
	t.Parallel()
	h := middleware.TraceProduced(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("o", nil)}, nil
	})
	out, err := h(message.NewMessage("m", nil))
	must(t, err)
	if len(out) != 1 || len(out[0].Metadata) != 0 {
		t.Fatalf("output %v with metadata %v; want it untouched", out, out[0].Metadata)
	}
}

// dropConsumer samples every span but a consumer span: a sampler that is
// not parent-based, which would keep a child of a dropped process span.
type dropConsumer struct{}

func (dropConsumer) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if p.Kind == trace.SpanKindConsumer {
		return sdktrace.SamplingResult{Decision: sdktrace.Drop}
	}
	return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample}
}
func (dropConsumer) Description() string { return "dropConsumer" }

// A delivery whose process span the sampler dropped gets no settle span (it
// would be an orphan, or dropped by a parent-based sampler anyway), and its
// settlement is still counted in the metrics.
func TestDroppedDeliveryStartsNoSettleSpanAndIsCounted(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name    string
		err     error
		outcome string
	}{{"success", nil, "done"}, {"error", errors.New("fail"), "retry"}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(dropConsumer{}))
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) })
			mw, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMeterProvider(mp))
			must(t, err)
			h := mw(func(*message.Message) ([]*message.Message, error) { return nil, c.err })
			for i := range 3 {
				_, _ = h(message.NewMessage("m-"+string(rune('a'+i)), nil))
			}
			if spans := rec.Ended(); len(spans) != 0 {
				t.Fatalf("%d spans ended (first %q); want none under dropped process spans", len(spans), spans[0].Name())
			}
			var rm metricdata.ResourceMetrics
			must(t, reader.Collect(context.Background(), &rm))
			got := map[string]int64{}
			for _, sm := range rm.ScopeMetrics {
				for _, m := range sm.Metrics {
					if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "settle.settlements" {
						for _, dp := range d.DataPoints {
							o, _ := dp.Attributes.Value(attribute.Key("settle.outcome"))
							got[o.AsString()] += dp.Value
						}
					}
				}
			}
			if got[c.outcome] != 3 || len(got) != 1 {
				t.Fatalf("settle.settlements = %v, want 3 %s", got, c.outcome)
			}
		})
	}
}

// settledKey is what the router did with a delivery, on its process span.
const settledKey = attribute.Key("settle.settled")
