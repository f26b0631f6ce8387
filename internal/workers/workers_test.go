package workers

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// router runs a router with one handler whose chain runs on a Pool, and
// returns the pool and a function that closes the router.
func router(t *testing.T, ps *gochannel.GoChannel, h message.NoPublishHandlerFunc) (*Pool, func()) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	handler := r.AddConsumerHandler("h", "t", ps, h)
	pool := New(func() <-chan struct{} { return handler.Stopped() })
	handler.AddMiddleware(pool.Middleware)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	return pool, func() {
		_ = r.Close()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

func publish(t *testing.T, ps *gochannel.GoChannel, n int) {
	t.Helper()
	for i := range n {
		if err := ps.Publish("t", message.NewMessage(strconv.Itoa(i), nil)); err != nil {
			t.Fatal(err)
		}
	}
}

func (p *Pool) startedWorkers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.started
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestOneWorkerServesDeliveriesOneAfterAnother(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer ps.Close()
	var runs atomic.Int64
	pool, stop := router(t, ps, func(*message.Message) error { runs.Add(1); return nil })
	publish(t, ps, 200)
	waitFor(t, "200 handler runs", func() bool { return runs.Load() == 200 })
	stop()
	if n := pool.startedWorkers(); n != 1 {
		t.Errorf("%d workers started for 200 deliveries one at a time, want 1", n)
	}
}

func TestAWorkerPerDeliveryInFlight(t *testing.T) {
	// A GoChannel subscriber that does not wait for acks has every
	// delivery in flight at once; each needs a worker of its own.
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	defer ps.Close()
	const n = 8
	var arrived sync.WaitGroup
	arrived.Add(n)
	release := make(chan struct{})
	var runs atomic.Int64
	pool, stop := router(t, ps, func(*message.Message) error {
		if runs.Add(1) <= n {
			arrived.Done()
			<-release
		}
		return nil
	})
	go func() {
		for i := range n {
			if err := ps.Publish("t", message.NewMessage(strconv.Itoa(i), nil)); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
		}
	}()
	waited := make(chan struct{})
	go func() { arrived.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		close(release)
		stop()
		t.Skip("GoChannel delivered one at a time; nothing to hold in flight")
	}
	close(release)
	waitFor(t, "the held deliveries", func() bool { return runs.Load() == n })
	stop()
	if got := pool.startedWorkers(); got != n {
		t.Errorf("%d workers for %d deliveries in flight at once, want %d", got, n, n)
	}
}

func TestPanicIsRaisedOnTheDeliverysGoroutine(t *testing.T) {
	stopped := make(chan struct{})
	defer close(stopped)
	p := New(func() <-chan struct{} { return stopped })
	h := p.Middleware(func(*message.Message) ([]*message.Message, error) { panic("boom") })
	for range 3 { // the worker survives a panic
		got := func() (r any) {
			defer func() { r = recover() }()
			_, _ = h(message.NewMessage("1", nil))
			return nil
		}()
		if got != "boom" {
			t.Fatalf("recovered %v on the delivery's goroutine, want the chain's panic", got)
		}
	}
	if n := p.startedWorkers(); n != 1 {
		t.Errorf("%d workers after 3 panics, want 1 (a panic does not end the worker)", n)
	}
}

func TestGoexitEndsTheDeliverysGoroutine(t *testing.T) {
	stopped := make(chan struct{})
	defer close(stopped)
	p := New(func() <-chan struct{} { return stopped })
	h := p.Middleware(func(*message.Message) ([]*message.Message, error) {
		runtime.Goexit()
		return nil, nil
	})
	for range 2 {
		returned, exited := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(exited)
			_, _ = h(message.NewMessage("1", nil))
			close(returned)
		}()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			t.Fatal("the delivery hangs after the chain called runtime.Goexit")
		}
		select {
		case <-returned:
			t.Fatal("the delivery went on after the chain called runtime.Goexit")
		default:
		}
	}
	if n := p.startedWorkers(); n != 2 {
		t.Errorf("%d workers started, want 2 (a Goexit ends its worker)", n)
	}
}

func TestResultsReachTheDelivery(t *testing.T) {
	stopped := make(chan struct{})
	defer close(stopped)
	p := New(func() <-chan struct{} { return stopped })
	want := errors.New("failed")
	h := p.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "bad" {
			return nil, want
		}
		return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
	})
	out, err := h(message.NewMessage("ok", nil))
	if err != nil || len(out) != 1 || out[0].UUID != "out-ok" {
		t.Fatalf("got %v, %v; want the chain's one message", out, err)
	}
	if _, err := h(message.NewMessage("bad", nil)); !errors.Is(err, want) {
		t.Fatalf("got %v, want the chain's error", err)
	}
}

func TestBeforeTheHandlerStartsTheChainRunsInPlace(t *testing.T) {
	p := New(func() <-chan struct{} { return nil })
	ran := false
	if _, err := p.Middleware(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })(message.NewMessage("1", nil)); err != nil || !ran {
		t.Fatalf("ran %v, err %v", ran, err)
	}
	if n := p.startedWorkers(); n != 0 {
		t.Errorf("%d workers started with no handler to stop them", n)
	}
}

func TestAfterTheHandlerStopsTheChainRunsInPlace(t *testing.T) {
	stopped := make(chan struct{})
	p := New(func() <-chan struct{} { return stopped })
	h := p.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := h(message.NewMessage("1", nil)); err != nil {
		t.Fatal(err)
	}
	close(stopped)
	for range 10 {
		if _, err := h(message.NewMessage("2", nil)); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.startedWorkers(); n != 1 {
		t.Errorf("%d workers started, want 1: none after the handler stopped", n)
	}
	// goleak (TestMain) checks that the worker left.
}
