package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// settling is the spans of one delivery still to end at its settlement: its
// process span, and the settle span under it when there is one (a nack, or
// a wait on the router's publish).
type settling struct {
	msg     *message.Message
	process trace.Span
	span    trace.Span // nil for a plain ack: the process span tells it
	decided string     // "ack" or "nack": what the middleware decided
	// recorded says the process span has its settle.settled already (the
	// settlement was known when the middleware finished).
	recorded bool
}

// settledName is the settle.settled value of an ack (true) or a nack.
func settledName(acked bool) string {
	if acked {
		return "ack"
	}
	return "nack"
}

// settled says whether the message was acked or nacked already (inside the
// chain).
func (w settling) settled() bool {
	select {
	case <-w.msg.Acked():
		return true
	case <-w.msg.Nacked():
		return true
	default:
		return false
	}
}

// acks says whether the delivery is acked: by the settlement already made
// if the message was settled inside the chain, else by the one the router
// is about to make (routerAcks).
func (w settling) acks(routerAcks bool) bool {
	select {
	case <-w.msg.Acked():
		return true
	case <-w.msg.Nacked():
		return false
	default:
		return routerAcks
	}
}

// endNow ends the spans for the settlement the router is about to make
// (routerAcks), or for the one already made if the message was settled
// inside the chain. It runs on the delivery's goroutine.
func (w settling) endNow(routerAcks bool) { w.end(w.acks(routerAcks)) }

// end ends the spans for the router's ack (true) or nack: the settle span,
// if any, then the process span, which records the settlement.
func (w settling) end(acked bool) {
	on := w.span
	if on == nil {
		on = w.process
	}
	switch {
	case acked && w.decided != "ack":
		on.SetAttributes(routerDecisionKey.String("ack"))
	case !acked && w.decided != "nack":
		on.SetAttributes(routerDecisionKey.String("nack"))
		on.SetStatus(codes.Error, "the router nacked a message the middleware settled as ack (publishing its produced messages failed?)")
	}
	if w.span != nil {
		w.span.End()
	}
	if !w.recorded {
		w.process.SetAttributes(settledKey.String(settledName(acked)))
	}
	w.process.End()
}

// pendingKey is the context key under which each message the chain returns
// for the router to publish carries its delivery's pending settle span.
type pendingKey struct{}

// pending is the settle span of a delivery whose output the router publishes
// after the middleware chain has returned. Whichever ends it first wins:
// TracePublished when the router's publish returns (on the delivery's
// goroutine, before the router acks or nacks), or else a goroutine of its
// own when the router acks or nacks, or the settle wait.
type pending struct {
	settling
	t     *tracing
	names *spanNames
	ended atomic.Bool

	// With a goroutine waiting (the handler's first deliveries, and every
	// one of a router without TracePublished): stop tells it that
	// TracePublished ended the span, and it closes exited as it returns.
	stop, exited chan struct{}
	// Without one (TracePublished has ended a span of this handler before):
	// the settle wait.
	timer *time.Timer
}

// claim says whether the caller is the one to end the span.
func (p *pending) claim() bool { return p.ended.CompareAndSwap(false, true) }

// awaitPublish leaves the settle span s to be ended once the router has
// published produced. Each produced message carries the pending span in its
// context for TracePublished to find. Once TracePublished has ended a span
// of this handler, the router has it among its publisher decorators, and
// only a timer stands by for the settle wait; until then a goroutine waits
// for the router's ack or nack too, and reports a missing TracePublished
// when it sees one first.
//
// Skipping the goroutine once the decorator is known saves 4 allocations
// and about 300 B per delivery against a goroutine and its hand-over for
// every one (time within noise: 6 interleaved runs of each build under a
// load of 13, go test -run XXX -bench BenchmarkRouterPublished/TracePublished
// -benchtime 20000x -benchmem, the other build with this branch disabled).
// The price: one tracing middleware shared by two routers, only one of them
// with TracePublished, with a handler of the same name and topic on both,
// ends the other's spans only after the settle wait, with an error.
func (t *tracing) awaitPublish(s settling, d *spanNames, produced []*message.Message) {
	p := &pending{settling: s, t: t, names: d}
	for _, m := range produced {
		if m != nil {
			m.SetContext(context.WithValue(m.Context(), pendingKey{}, p))
		}
	}
	if d.published.Load() {
		p.timer = time.AfterFunc(t.cfg.SettleWait, func() {
			if p.claim() {
				p.expire()
			}
		})
		return
	}
	p.stop, p.exited = make(chan struct{}), make(chan struct{})
	go p.await()
}

// await waits, on a goroutine of its own, for TracePublished to end the
// span, or else for the router's ack or nack (Watermill reports them only
// by closing the message's channels), or the settle wait.
//
// One goroutine and timer per such delivery is the plain way. A single
// goroutine per middleware waiting on all of them with reflect.Select was
// measured against it in one run (go test -bench of both, since removed
// with it: -benchtime=200000x -count=3, 1, 16 and 64 deliveries in flight,
// noop and SDK spans, on a shared 2-core machine): 18.6-63.2µs per delivery
// for it against 10.9-50.5µs for this, each within the other's spread, so
// it did not earn its place. With TracePublished on the router, only a
// handler's first deliveries start one.
func (p *pending) await() {
	defer close(p.exited)
	timer := time.NewTimer(p.t.cfg.SettleWait)
	defer timer.Stop()
	select {
	case <-p.stop:
	case <-p.msg.Acked():
		if p.claim() {
			p.end(true)
			p.t.reportUnpublished(p.names)
		}
	case <-p.msg.Nacked():
		if p.claim() {
			p.end(false)
			p.t.reportUnpublished(p.names)
		}
	case <-timer.C:
		if p.claim() {
			p.expire()
		}
	}
}

// expire ends the span of a delivery the router did not settle within the
// settle wait.
func (p *pending) expire() {
	p.span.SetStatus(codes.Error, "not acked or nacked within "+p.t.cfg.SettleWait.String())
	p.span.End()
	p.process.End()
}

// published ends the span once the router's publish of the delivery's
// output has returned err: the router nacks when it failed and acks
// otherwise. It runs on the delivery's goroutine.
func (p *pending) published(err error) {
	if !p.claim() {
		return
	}
	p.names.published.Store(true)
	if p.timer != nil {
		p.timer.Stop()
	}
	p.endNow(err == nil)
	if p.stop != nil {
		close(p.stop)
		<-p.exited // no goroutine of the delivery outlives it
	}
}

// reportUnpublished tells the OpenTelemetry error handler, once per tracing
// middleware, that a settle span ended when the router acked or nacked,
// without TracePublished seeing the router's publish.
func (t *tracing) reportUnpublished(d *spanNames) {
	if t.warned.CompareAndSwap(false, true) {
		otel.Handle(fmt.Errorf("settle: the router published the output of handler %q with no middleware.TracePublished among its publisher decorators: its settle spans end when the router acks, which can be after router.Close returns, and a tracer provider shut down then drops them; add router.AddPublisherDecorators(middleware.TracePublished)", d.handler))
	}
}

// TracePublished is a Watermill publisher decorator for a router with the
// tracing middleware (NewTracing) whose handlers return messages for the
// router itself to publish:
//
//	router.AddPublisherDecorators(middleware.TracePublished)
//
// The router publishes a handler's output after the middleware chain has
// returned, then acks the delivery, or nacks it when publishing failed.
// The delivery's process span stays open until then, with an ack span under
// it for the wait. With TracePublished, both end when that publish
// returns, on the delivery's own goroutine, before the router settles the
// message; router.Close waits for that goroutine, so they have ended
// when Close returns, and a tracer provider shut down right after exports
// them. Without it, they end when the router acks or nacks, on a
// goroutine of its own, which can be just after Close returns; the tracing
// middleware then reports the missing decorator once to the OpenTelemetry
// error handler (otel.Handle).
//
// Watermill applies the first publisher decorator added outermost: add
// TracePublished before any publisher decorator of your own, so that the
// span sees the publish the router sees. It changes nothing else: messages
// other than a traced delivery's output pass through as they are, and
// Close closes the publisher it decorates. Not needed when the output is
// published inside the chain (pipeline, or dedupe.Config.Publisher): the
// spans then end before the chain returns.
func TracePublished(pub message.Publisher) (message.Publisher, error) {
	if pub == nil {
		return nil, nil
	}
	return tracedPublisher{pub}, nil
}

type tracedPublisher struct{ message.Publisher }

func (p tracedPublisher) Publish(topic string, msgs ...*message.Message) (err error) {
	returned := false
	defer func() {
		if !returned {
			// A panicking publish: the router recovers it and nacks.
			settlePublished(msgs, errPublishPanicked)
		}
	}()
	err = p.Publisher.Publish(topic, msgs...)
	returned = true
	settlePublished(msgs, err)
	return err
}

var errPublishPanicked = errors.New("publish panicked")

// settlePublished ends the pending settle spans whose output msgs are.
func settlePublished(msgs []*message.Message, err error) {
	for _, m := range msgs {
		if m == nil {
			continue
		}
		if p, ok := m.Context().Value(pendingKey{}).(*pending); ok {
			p.published(err)
		}
	}
}
