// Package workers runs a router handler's middleware chain on goroutines
// that are kept from one delivery to the next.
//
// A Watermill router runs each delivery on a new goroutine, whose stack
// starts at the runtime's starting size (2 KB when most of the process's
// goroutines are shallow). settle's chain of middleware needs about twice
// that, so each delivery's goroutine had its stack grown and copied, and
// freed when it exited; on a fast handler that was the largest single cost
// settle added. A kept worker keeps its grown stack, and a delivery pays
// two goroutine switches instead (the delivery's goroutine hands the chain
// to a worker and waits for it).
package workers

import (
	"runtime"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Pool is the workers of one router handler: one per delivery in flight at
// its busiest, each kept until the handler stops. Create it with New.
type Pool struct {
	stopped func() <-chan struct{} // the handler's Stopped, asked for at the first delivery

	mu      sync.Mutex
	idle    []*worker
	stop    <-chan struct{}
	started int // workers started, for tests
}

// New returns a pool whose workers exit when stopped's channel is closed.
// stopped is the router handler's Stopped (message.Handler.Stopped); the
// router makes that channel when it starts the handler, so the pool asks
// for it at the first delivery. Until there is a channel to watch (nil),
// deliveries run on their own goroutine as usual.
func New(stopped func() <-chan struct{}) *Pool { return &Pool{stopped: stopped} }

type worker struct {
	start chan struct{}
	done  chan struct{}

	// Set by the delivery before start, read by it after done.
	h      message.HandlerFunc
	msg    *message.Message
	out    []*message.Message
	err    error
	panic  any
	exited bool // the chain called runtime.Goexit; the worker is gone
}

// Middleware runs the rest of the chain on a worker and waits for it. What
// the chain returns, panics with or (runtime.Goexit) exits with happens on
// the delivery's goroutine, as if the chain had run there.
func (p *Pool) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		w, stop := p.get()
		if w == nil {
			return h(msg)
		}
		w.h, w.msg = h, msg
		select {
		case w.start <- struct{}{}:
		case <-stop:
			// The handler stopped; its workers are leaving.
			w.h, w.msg = nil, nil
			return h(msg)
		}
		<-w.done
		out, err, pv, exited := w.out, w.err, w.panic, w.exited
		w.h, w.msg, w.out, w.err, w.panic = nil, nil, nil, nil, nil
		if exited {
			runtime.Goexit()
		}
		p.put(w)
		if pv != nil {
			panic(pv)
		}
		return out, err
	}
}

func (p *Pool) get() (*worker, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stop == nil {
		if p.stop = p.stopped(); p.stop == nil {
			return nil, nil
		}
	}
	select {
	case <-p.stop:
		return nil, nil
	default:
	}
	if n := len(p.idle); n > 0 {
		w := p.idle[n-1] // the most recently used: its stack is warm
		p.idle[n-1] = nil
		p.idle = p.idle[:n-1]
		return w, p.stop
	}
	w := &worker{start: make(chan struct{}), done: make(chan struct{})}
	p.started++
	go w.loop(p.stop)
	return w, p.stop
}

func (p *Pool) put(w *worker) {
	p.mu.Lock()
	p.idle = append(p.idle, w)
	p.mu.Unlock()
}

func (w *worker) loop(stop <-chan struct{}) {
	for {
		select {
		case <-w.start:
			w.call()
			w.done <- struct{}{}
		case <-stop:
			return
		}
	}
}

// call runs the chain once. A panic is kept for the delivery; a Goexit
// ends this worker, after telling the delivery.
func (w *worker) call() {
	returned := false
	defer func() {
		if returned {
			return
		}
		if r := recover(); r != nil {
			w.panic = r
			return
		}
		w.exited = true
		w.done <- struct{}{}
	}()
	w.out, w.err = w.h(w.msg)
	returned = true
}
