package amqpsub_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
)

// errorLog is a logger that keeps the errors it is given.
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := msg
	if err != nil {
		s += ": " + err.Error()
	}
	l.errs = append(l.errs, s)
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// unexpected is the errors logged that contain none of expected.
func (l *errorLog) unexpected(expected ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
next:
	for _, e := range l.errs {
		for _, x := range expected {
			if strings.Contains(e, x) {
				continue next
			}
		}
		out = append(out, e)
	}
	return out
}

// next is the next message of msgs, or nil when none comes within d or msgs
// is closed.
func next(msgs <-chan *message.Message, d time.Duration) *message.Message {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case m := <-msgs:
		return m
	case <-timer.C:
		return nil
	}
}

// namedSubscriber is f's subscriber on a connection of its own name, which
// closeConnection can close.
func (f *fixture) namedSubscriber(t *testing.T, inFlight int, logger watermill.LoggerAdapter) (*amqpsub.Subscriber, string) {
	t.Helper()
	name := testenv.Name(t, "conn")
	f.cfg.Connection.AmqpConfig = &amqp091.Config{Heartbeat: 10 * time.Second, Locale: "en_US",
		Properties: amqp091.Table{"connection_name": name}}
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: inFlight}, logger)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub, name
}
