package amqpsub

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// conn is the subscriber's AMQP connection, dialled again with backoff when
// it is lost. watermill-amqp's ConnectionWrapper does the same, but swaps
// its connection and its "connected" channel without a lock while others
// read them, which the race detector reports on every reconnection; conn
// hands both out under its mutex.
type conn struct {
	cfg    amqp.ConnectionConfig
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	c       *amqp091.Connection // nil while the connection is down
	up      chan struct{}       // closed while c is usable
	closing chan struct{}       // closed by close
	stopped chan struct{}       // closed when watch returned
}

// dialConn dials cfg once (an error if that fails, as watermill-amqp's
// NewConnection) and keeps the connection up until close.
func dialConn(cfg amqp.ConnectionConfig, logger watermill.LoggerAdapter) (*conn, error) {
	if cfg.AmqpConfig != nil && cfg.AmqpConfig.TLSClientConfig != nil && cfg.TLSConfig != nil {
		return nil, errors.New("both Connection.AmqpConfig.TLSClientConfig and Connection.TLSConfig are set")
	}
	k := &conn{cfg: cfg, logger: logger, up: make(chan struct{}), closing: make(chan struct{}), stopped: make(chan struct{})}
	c, err := k.dial()
	if err != nil {
		return nil, err
	}
	k.c = c
	close(k.up)
	go k.watch(c)
	return k, nil
}

// dial connects as amqp091's Dial, DialTLS or DialConfig would for the
// configuration, with a socket that close shuts if it comes while the
// connection is being made, so that close never waits for a handshake
// that does not end.
func (k *conn) dial() (*amqp091.Connection, error) {
	cfg := amqp091.Config{Heartbeat: 10 * time.Second, Locale: "en_US"} // amqp091.Dial's
	switch {
	case k.cfg.AmqpConfig != nil:
		cfg = *k.cfg.AmqpConfig
	case k.cfg.TLSConfig != nil:
		cfg.TLSClientConfig = k.cfg.TLSConfig
	}
	open := cfg.Dial
	if open == nil {
		open = amqp091.DefaultDial(30 * time.Second)
	}
	dialled := make(chan struct{})
	var wg sync.WaitGroup
	defer func() {
		close(dialled)
		wg.Wait()
	}()
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		c, err := open(network, addr)
		if err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-k.closing:
				_ = c.Close()
			case <-dialled:
			}
		}()
		return c, nil
	}
	c, err := amqp091.DialConfig(k.cfg.AmqpURI, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to AMQP: %w", err)
	}
	return c, nil
}

// current returns the connection (nil while it is down) and a channel that
// is closed while it is up.
func (k *conn) current() (*amqp091.Connection, <-chan struct{}) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.c, k.up
}

// watch dials again each time the connection is lost, until close.
func (k *conn) watch(c *amqp091.Connection) {
	defer close(k.stopped)
	for {
		lost := c.NotifyClose(make(chan *amqp091.Error, 1))
		select {
		case <-k.closing:
			return
		case err := <-lost:
			if err != nil { // nil when it was closed without an error
				k.logger.Error("amqpsub: connection lost, reconnecting", err, nil)
			}
		}
		k.mu.Lock()
		k.c, k.up = nil, make(chan struct{})
		k.mu.Unlock()
		var ok bool
		if c, ok = k.redial(); !ok {
			return
		}
		k.mu.Lock()
		k.c = c
		close(k.up)
		k.mu.Unlock()
		k.logger.Info("amqpsub: reconnected", nil)
	}
}

// redial dials until it succeeds or close is called; it backs off as the
// connection's Reconnect settings say (watermill-amqp's defaults when nil).
func (k *conn) redial() (*amqp091.Connection, bool) {
	r := k.cfg.Reconnect
	if r == nil {
		r = amqp.DefaultReconnectConfig()
	}
	initial := r.BackoffInitialInterval
	if initial <= 0 {
		initial = amqp.DefaultReconnectConfig().BackoffInitialInterval
	}
	most := max(r.BackoffMaxInterval, initial)
	spread := min(max(r.BackoffRandomizationFactor, 0), 1)
	wait := initial
	for {
		if ended(k.closing) {
			return nil, false
		}
		c, err := k.dial()
		if err == nil {
			if ended(k.closing) {
				_ = c.Close()
				return nil, false
			}
			return c, true
		}
		k.logger.Error("amqpsub: cannot reconnect, retrying", err, watermill.LogFields{"wait": wait})
		jitter := 1 + spread*(2*rand.Float64()-1)
		t := time.NewTimer(time.Duration(float64(wait) * jitter))
		select {
		case <-k.closing:
			t.Stop()
			return nil, false
		case <-t.C:
		}
		wait = min(time.Duration(float64(wait)*max(r.BackoffMultiplier, 1)), most)
	}
}

// close stops reconnecting and closes the connection.
func (k *conn) close() error {
	close(k.closing)
	<-k.stopped
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.c == nil {
		return nil
	}
	err := k.c.Close()
	k.c = nil
	return ignoreClosed(err)
}
