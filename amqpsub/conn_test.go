package amqpsub_test

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpsub"
)

// dialer dials the broker once for real and hands each later dial (the
// subscriber's reconnections) to redial. drop closes the first connection
// from the client's side, which amqp091 reports as a lost connection.
type dialer struct {
	redial func(network, addr string) (net.Conn, error)

	mu    sync.Mutex
	first net.Conn
	calls atomic.Int64
}

func (d *dialer) dial(network, addr string) (net.Conn, error) {
	if d.calls.Add(1) > 1 {
		return d.redial(network, addr)
	}
	c, err := net.DialTimeout(network, addr, 10*time.Second)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.first = c
	d.mu.Unlock()
	return c, nil
}

func (d *dialer) drop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	_ = d.first.Close()
}

func (f *fixture) subscriberDialingWith(t *testing.T, d *dialer, reconnect *amqp.ReconnectConfig) *amqpsub.Subscriber {
	t.Helper()
	f.cfg.Connection.AmqpConfig = &amqp091.Config{Heartbeat: 10 * time.Second, Locale: "en_US", Dial: d.dial}
	f.cfg.Connection.Reconnect = reconnect
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: 4}, nil)
	must(t, err)
	return sub
}

// A Reconnect whose intervals are left at zero gets the default initial
// interval, and the attempts stay that far apart: the backoff must not
// shrink to nothing after the first failed attempt and redial in a tight
// loop while the broker is unreachable.
func TestReconnectWithZeroIntervalsBacksOff(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 0)
	d := &dialer{redial: func(string, string) (net.Conn, error) {
		return nil, errors.New("broker unreachable (test)")
	}}
	sub := f.subscriberDialingWith(t, d, &amqp.ReconnectConfig{})
	d.drop()
	time.Sleep(1200 * time.Millisecond)
	// The first redial comes at once, the next ones 500ms apart (the
	// default initial interval; no randomization, multiplier 1).
	if n := d.calls.Load() - 1; n > 5 {
		t.Errorf("%d reconnection attempts within 1.2s of losing the connection, want at most 5", n)
	}
	must(t, sub.Close())
}

// Close returns promptly while the subscriber is reconnecting to a broker
// that accepts the TCP connection but never answers the AMQP handshake (a
// hung broker, or one behind a proxy that is cut off): it must not wait
// for that handshake, which a Dial of one's own leaves without a deadline
// and amqp091's own dialer bounds only at 30s.
func TestCloseDoesNotWaitForAHungRedial(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 0)
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	var accepted []net.Conn
	var mu sync.Mutex
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			accepted = append(accepted, c)
			mu.Unlock()
		}
	}()
	release := func() {
		_ = silent.Close()
		<-acceptDone
		mu.Lock()
		defer mu.Unlock()
		for _, c := range accepted {
			_ = c.Close()
		}
	}
	defer release()
	redialing := make(chan struct{}, 1)
	d := &dialer{redial: func(network, _ string) (net.Conn, error) {
		select {
		case redialing <- struct{}{}:
		default:
		}
		return net.DialTimeout(network, silent.Addr().String(), 10*time.Second)
	}}
	sub := f.subscriberDialingWith(t, d, nil)
	d.drop()
	select {
	case <-redialing:
	case <-time.After(10 * time.Second):
		t.Fatal("no reconnection attempt within 10s of losing the connection")
	}
	time.Sleep(100 * time.Millisecond) // the handshake is under way
	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case err := <-closed:
		must(t, err)
	case <-time.After(2 * time.Second):
		t.Error("Close did not return within 2s while a reconnection's handshake hung")
		release() // the handshake fails, and Close can end
		must(t, <-closed)
	}
}
