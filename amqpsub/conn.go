package amqpsub

import (
	"errors"
	"fmt"
	"math/rand/v2"
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
	c, err := dial(cfg)
	if err != nil {
		return nil, err
	}
	k := &conn{cfg: cfg, logger: logger, c: c, up: make(chan struct{}), closing: make(chan struct{}), stopped: make(chan struct{})}
	close(k.up)
	go k.watch(c)
	return k, nil
}

func dial(cfg amqp.ConnectionConfig) (*amqp091.Connection, error) {
	var c *amqp091.Connection
	var err error
	switch {
	case cfg.AmqpConfig != nil:
		c, err = amqp091.DialConfig(cfg.AmqpURI, *cfg.AmqpConfig)
	case cfg.TLSConfig != nil:
		c, err = amqp091.DialTLS(cfg.AmqpURI, cfg.TLSConfig)
	default:
		c, err = amqp091.Dial(cfg.AmqpURI)
	}
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
			k.logger.Error("amqpsub: connection lost, reconnecting", err, nil)
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
	wait := r.BackoffInitialInterval
	if wait <= 0 {
		wait = amqp.DefaultReconnectConfig().BackoffInitialInterval
	}
	for {
		c, err := dial(k.cfg)
		if err == nil {
			select {
			case <-k.closing:
				_ = c.Close()
				return nil, false
			default:
				return c, true
			}
		}
		k.logger.Error("amqpsub: cannot reconnect, retrying", err, watermill.LogFields{"wait": wait})
		jitter := 1 + r.BackoffRandomizationFactor*(2*rand.Float64()-1)
		t := time.NewTimer(time.Duration(float64(wait) * jitter))
		select {
		case <-k.closing:
			t.Stop()
			return nil, false
		case <-t.C:
		}
		wait = min(time.Duration(float64(wait)*max(r.BackoffMultiplier, 1)), max(r.BackoffMaxInterval, r.BackoffInitialInterval))
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
