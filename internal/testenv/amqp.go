package testenv

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Messages of watermill-amqp v3.0.2's ConnectionWrapper (pkg/amqp/connection.go)
// that AMQPLogger waits on; see there.
const (
	// Logged by ConnectionWrapper.Close at Info after it closed its closing
	// channel and before it closes the amqp091 connection.
	amqpClosingMsg = "Closing AMQP Pub/Sub"
	// Logged at Debug by the wrapper's handleConnectionClose goroutine when
	// it took the closing case of its select and is about to return.
	amqpStoppedMsg = "Stopping handleConnectionClose"
	// How long Close is held back at most; the goroutine normally stops
	// within microseconds.
	amqpStopWait = 15 * time.Second
)

// AMQPLogger returns the logger to give exactly one watermill-amqp Publisher
// or Subscriber that owns its connection (amqp.NewPublisher,
// amqp.NewSubscriber; one AMQPLogger each, never shared). It passes every call
// on to logger (nil means watermill.NopLogger{}); its only other job is to
// work around a race in watermill-amqp v3.0.2 that leaks the connection on
// Close, which goleak then reports as an amqp091 reader and heartbeater.
//
// The race: ConnectionWrapper.Close closes its closing channel and then
// closes the amqp091 connection gracefully, which closes the connection's
// close-notification channels. The wrapper's handleConnectionClose goroutine
// selects on both. If that goroutine reaches its select only after the
// connection was closed (it had not been scheduled since NewConnection, or
// was held up under load), both cases are ready, select picks one at random,
// and half of the time the goroutine "reconnects": it dials a new connection
// that nothing ever closes.
//
// Close logs amqpClosingMsg between the two steps, and the goroutine logs
// amqpStoppedMsg once it chose the closing case. This logger holds the first
// call until the second happened, so the connection is closed only after the
// goroutine stopped and the random choice cannot arise. If the goroutine does
// not stop within amqpStopWait (a watermill-amqp whose messages changed, or a
// reconnect that never succeeds), t fails and Close goes on.
func AMQPLogger(t testing.TB, logger watermill.LoggerAdapter) watermill.LoggerAdapter {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &amqpLogger{LoggerAdapter: logger, t: t, guard: &amqpGuard{stopped: make(chan struct{})}}
}

type amqpGuard struct {
	once    sync.Once
	stopped chan struct{} // closed when the wrapper's goroutine stopped
}

type amqpLogger struct {
	watermill.LoggerAdapter
	t     testing.TB
	guard *amqpGuard
}

func (l *amqpLogger) Info(msg string, fields watermill.LogFields) {
	if msg == amqpClosingMsg {
		timer := time.NewTimer(amqpStopWait)
		select {
		case <-l.guard.stopped:
		case <-timer.C:
			l.t.Errorf("testenv: watermill-amqp's connection goroutine did not log %q within %v of %q; closing anyway, the connection may leak", amqpStoppedMsg, amqpStopWait, amqpClosingMsg)
		}
		timer.Stop()
	}
	l.LoggerAdapter.Info(msg, fields)
}

func (l *amqpLogger) Debug(msg string, fields watermill.LogFields) {
	if msg == amqpStoppedMsg {
		l.guard.once.Do(func() { close(l.guard.stopped) })
	}
	l.LoggerAdapter.Debug(msg, fields)
}

func (l *amqpLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &amqpLogger{LoggerAdapter: l.LoggerAdapter.With(fields), t: l.t, guard: l.guard}
}
