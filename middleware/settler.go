package middleware

import (
	"reflect"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// settleTick is how often the settler looks for settle spans that waited
// their whole settle wait, and how long it stays when nothing waits.
const settleTick = 10 * time.Millisecond

// maxWatched bounds the deliveries the settler's goroutine waits for at
// once: a select over all of them costs time in their number on every
// event. Deliveries beyond it get a goroutine of their own.
const maxWatched = 32

// settler ends settle spans when the router acks or nacks their messages.
//
// Watermill says that a message was settled only by closing its Acked or
// Nacked channel, after the middleware chain has returned, so something has
// to wait on those channels. One goroutine per tracing middleware waits on
// all the deliveries in flight at once (a reflect.Select over their
// channels) instead of one goroutine and one timer per delivery; it runs
// while any delivery waits and one tick after, so a stream of messages keeps
// it and an idle router does not.
type settler struct {
	wait time.Duration // settleWait
	tick time.Duration

	mu      sync.Mutex
	added   []settling // handed over to the goroutine at its next wake-up
	watched int        // deliveries the goroutine waits for, added included
	running bool
	wake    chan struct{} // buffered 1: added is not empty
}

// settling is one settle span waiting for its message's ack or nack.
type settling struct {
	msg      *message.Message
	span     trace.Span
	decided  string // "ack" or "nack": what the middleware decided
	deadline time.Time
}

func newSettler(wait time.Duration) *settler {
	return &settler{wait: wait, tick: min(settleTick, wait), wake: make(chan struct{}, 1)}
}

// add ends span when msg is acked or nacked, or after the settle wait.
func (s *settler) add(msg *message.Message, span trace.Span, decided string) {
	st := settling{msg: msg, span: span, decided: decided, deadline: time.Now().Add(s.wait)}
	s.mu.Lock()
	if s.watched >= maxWatched {
		s.mu.Unlock()
		go st.await(s.wait)
		return
	}
	s.added = append(s.added, st)
	s.watched++
	start := !s.running
	s.running = true
	s.mu.Unlock()
	if start {
		go s.run()
		return
	}
	select {
	case s.wake <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// run is the settler's goroutine: it waits for the acks and nacks of the
// deliveries added, and returns after a tick with none.
func (s *settler) run() {
	ticker := time.NewTicker(s.tick)
	defer ticker.Stop()
	var (
		waiting []settling
		cases   = []reflect.SelectCase{
			{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(s.wake)},
			{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ticker.C)},
		}
		busy bool // a delivery was added or waited since the last tick
	)
	for {
		s.mu.Lock()
		if len(s.added) > 0 {
			waiting = append(waiting, s.added...)
			clear(s.added)
			s.added = s.added[:0]
			busy = true
		}
		s.mu.Unlock()
		// A delivery is often settled before the select is built.
		waiting = s.endSettled(waiting)

		cases = cases[:2]
		for _, w := range waiting {
			cases = append(cases,
				reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(w.msg.Acked())},
				reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(w.msg.Nacked())})
		}
		chosen, _, _ := reflect.Select(cases)
		switch chosen {
		case 0: // added
		case 1: // tick
			now := time.Now()
			kept := waiting[:0]
			for _, w := range waiting {
				if now.Before(w.deadline) {
					kept = append(kept, w)
					continue
				}
				w.span.SetStatus(codes.Error, "not acked or nacked within "+s.wait.String())
				w.span.End()
				s.done()
			}
			clear(waiting[len(kept):])
			waiting = kept
			if len(waiting) == 0 && !busy && s.stop() {
				return
			}
			busy = false
		default:
			i := (chosen - 2) / 2
			waiting[i].end(chosen%2 == 0)
			s.done()
			copy(waiting[i:], waiting[i+1:])
			waiting[len(waiting)-1] = settling{}
			waiting = waiting[:len(waiting)-1]
		}
	}
}

// endSettled ends the spans of the deliveries already acked or nacked and
// returns the others.
func (s *settler) endSettled(waiting []settling) []settling {
	kept := waiting[:0]
	for _, w := range waiting {
		select {
		case <-w.msg.Acked():
			w.end(true)
			s.done()
		case <-w.msg.Nacked():
			w.end(false)
			s.done()
		default:
			kept = append(kept, w)
		}
	}
	clear(waiting[len(kept):])
	return kept
}

// done counts one delivery as no longer watched.
func (s *settler) done() {
	s.mu.Lock()
	s.watched--
	s.mu.Unlock()
}

// stop ends the goroutine unless a delivery was added meanwhile.
func (s *settler) stop() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.added) > 0 {
		return false
	}
	s.running = false
	return true
}

// end ends the span for the router's ack (true) or nack.
func (w settling) end(acked bool) {
	switch {
	case acked && w.decided != "ack":
		w.span.SetAttributes(attribute.String("settle.router_decision", "ack"))
	case !acked && w.decided != "nack":
		w.span.SetAttributes(attribute.String("settle.router_decision", "nack"))
		w.span.SetStatus(codes.Error, "the router nacked a message the middleware settled as ack (publishing its produced messages failed?)")
	}
	w.span.End()
}

// await is end for a delivery beyond maxWatched, on a goroutine of its own.
func (w settling) await(wait time.Duration) {
	timer := time.NewTimer(time.Until(w.deadline))
	defer timer.Stop()
	select {
	case <-w.msg.Acked():
		w.end(true)
	case <-w.msg.Nacked():
		w.end(false)
	case <-timer.C:
		w.span.SetStatus(codes.Error, "not acked or nacked within "+wait.String())
		w.span.End()
	}
}
