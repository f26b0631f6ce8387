package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
)

// amqpFlags are the connection flags of the dlq commands.
type amqpFlags struct {
	url        string
	queue      string
	uuidHeader string
	force      bool // read a queue that counts deliveries
}

// register adds the flags to fs. The URL's default is read after parsing
// (see openDLQ), so that -h does not print a password from the environment.
func (f *amqpFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.url, "amqp", "", "RabbitMQ URL (default $"+envAMQPURL+")")
	fs.StringVar(&f.queue, "queue", "", "the dead-letter or poison queue (required)")
	fs.StringVar(&f.uuidHeader, "uuid-header", amqp.DefaultMessageUUIDHeaderKey, "header holding the message UUID (amqpmarshal.Config.MessageUUIDHeaderKey)")
	fs.BoolVar(&f.force, "force", false, "read a queue that counts deliveries (a quorum queue), although every message read counts as a delivery and a delivery limit may drop or dead-letter it")
}

// parse is parse for a dlq command: -queue is required.
func (f *amqpFlags) parse(e *env, fs *flag.FlagSet, name string, args []string) ([]string, error) {
	pos, err := parse(e, fs, name, args)
	if err == nil && f.queue == "" {
		err = usagef(fs, name, "-queue is required")
	}
	return pos, err
}

// dlqSession reads a queue with basic.get and manual acknowledgement. Every
// message it got and did not ack is held by its channel, so the next get
// returns the next message, and is handed back to the queue, in its place,
// by close: nothing is removed except by ack.
type dlqSession struct {
	conn      *amqp091.Connection
	ch        *amqp091.Channel
	queue     string
	marshaler amqpmarshal.Marshaler
	depth     int // messages ready when the session started
	held      int // messages got and not acked

	// counting is what the probe found: queueClassic, queueCounts, or
	// queueMayCount when it could not tell.
	counting queueKind
	force    bool // -force: read it anyway
	stderr   io.Writer
	// maxDeliveries is the highest x-delivery-count of a message read.
	maxDeliveries int64
}

// openDLQ connects, checks that the queue exists and opens the reading
// channel. On error nothing is left open.
func openDLQ(e *env, f amqpFlags) (*dlqSession, error) {
	ctx := e.ctx
	if f.url == "" {
		f.url = e.getenv(envAMQPURL)
	}
	m, err := amqpmarshal.New(amqpmarshal.Config{MessageUUIDHeaderKey: f.uuidHeader})
	if err != nil {
		return nil, fmt.Errorf("-uuid-header: %w", err)
	}
	conn, err := dialAMQP(ctx, f.url)
	if err != nil {
		return nil, err
	}
	q, err := inspectQueue(conn, f.queue)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	if q.Consumers > 0 {
		fmt.Fprintf(e.stderr, "warning: queue %s has %d consumer(s): the messages this command reads are held from them until it ends, and a dead-letter or poison queue should have none\n", safeLine(f.queue), q.Consumers)
	}
	// An empty queue is read not at all: nothing to spend, nothing to ask.
	kind, perr := queueClassic, error(nil)
	if q.Messages > 0 {
		kind, perr = probeQueueKind(ctx, f.url, f.queue)
	}
	switch {
	case kind == queueCounts && !f.force:
		_ = conn.Close()
		return nil, fmt.Errorf("%w: %s", errCountsDeliveries, countingHelp(f.queue))
	case kind == queueCounts:
		fmt.Fprintf(e.stderr, "warning: %s (-force)\n", safeLine(countingHelp(f.queue)))
	case kind == queueMayCount:
		fmt.Fprintf(e.stderr, "warning: cannot tell whether queue %s counts deliveries (%s); the command stops at the first message that carries a delivery count\n", safeLine(f.queue), safeLine(fmt.Sprint(perr)))
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("open channel: %w", err)
	}
	return &dlqSession{conn: conn, ch: ch, queue: f.queue, marshaler: m, depth: q.Messages, counting: kind, force: f.force, stderr: e.stderr}, nil
}

// next gets the next message, or ok=false when the queue has no more ready
// messages.
func (s *dlqSession) next() (d amqp091.Delivery, e entry, ok bool, err error) {
	d, ok, err = s.ch.Get(s.queue, false)
	if err != nil {
		return d, e, false, fmt.Errorf("get from %q: %w", s.queue, err)
	}
	if !ok {
		return d, e, false, nil
	}
	s.held++
	if n, ok := deliveryCount(d); ok {
		s.maxDeliveries = max(s.maxDeliveries, n)
		if !s.force {
			// The probe could not tell (or was wrong), and the broker
			// counts: stop before a second message is spent. A producer
			// may have set the header on a classic queue; -force reads on.
			return d, e, false, fmt.Errorf("%w: a message on queue %s carries x-delivery-count %d, which quorum queues set on every delivery; %s",
				errCountsDeliveries, s.queue, n, countingHelp(s.queue))
		}
	}
	e, err = decode(s.marshaler, d)
	return d, e, true, err
}

// deliveryCount returns the x-delivery-count header that quorum queues set
// on every delivery.
func deliveryCount(d amqp091.Delivery) (int64, bool) {
	switch v := d.Headers["x-delivery-count"].(type) {
	case int64:
		return v, true
	case int32:
		return int64(v), true
	case int16:
		return int64(v), true
	case int8:
		return int64(v), true
	case int:
		return int64(v), true
	}
	return 0, false
}

// ack removes d from the queue.
func (s *dlqSession) ack(d amqp091.Delivery) error {
	if err := s.ch.Ack(d.DeliveryTag, false); err != nil {
		return fmt.Errorf("ack %q on %q: %w", d.MessageId, s.queue, err)
	}
	s.held--
	return nil
}

// close hands every held message back to the queue and closes the channel
// and the connection. The nack has delivery tag 0 and multiple set, which
// the broker reads as "every unacknowledged delivery on this channel", and
// requeue set: RabbitMQ puts requeued messages back in their place.
func (s *dlqSession) close() error {
	if s.force && s.held > 0 && s.counting != queueClassic {
		fmt.Fprintf(s.stderr, "note: the messages read had been delivered up to %d times before (x-delivery-count); handing them back adds one\n", s.maxDeliveries)
	}
	var errs []error
	if s.held > 0 {
		if err := s.ch.Nack(0, true, true); err != nil {
			errs = append(errs, fmt.Errorf("return messages to %q: %w", s.queue, err))
		}
	}
	if err := s.ch.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		errs = append(errs, err)
	}
	if err := s.conn.Close(); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
