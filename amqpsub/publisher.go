package amqpsub

import (
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// defaultPublishChannels is how many AMQP channels a Publisher publishes on
// at once when Config.AMQP.Publish.ChannelPoolSize is not set.
const defaultPublishChannels = 16

// ErrUnroutable is wrapped by the error Publish returns for a message that
// the broker returned (basic.return) because no queue is bound to its
// exchange for its routing key: RabbitMQ confirms such a message all the
// same, and it is gone. The error names the message, the exchange and the
// routing key.
var ErrUnroutable = errors.New("amqpsub: the broker routed the message to no queue")

// ErrNotConfirmed is wrapped by the error Publish returns for a message that
// the broker did not confirm: it refused it (basic.nack), or the channel or
// the connection was lost, or the publisher was closed, or the message's
// context ended, before the confirmation came. The message may or may not
// be on a queue; it must be taken as not published.
var ErrNotConfirmed = errors.New("amqpsub: the broker did not confirm the message")

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// AMQP is watermill-amqp's configuration, used as its own Publisher
	// uses it: the connection and its reconnection backoff
	// (Connection.Reconnect; amqp091's Connection.AmqpConfig.Recovery is
	// refused, the publisher dials again by itself), the exchange name of a
	// topic (Exchange.GenerateName; a named exchange is declared through
	// TopologyBuilder.ExchangeDeclare before the first message to it on a
	// connection), Publish.GenerateRoutingKey and the marshaler. Queue and
	// QueueBind are used by SubscribeInitialize only.
	//
	// Every message is published with the mandatory flag and waits for the
	// broker's confirmation, whatever Publish.Mandatory and
	// Publish.ConfirmDelivery say. Publish.ChannelPoolSize bounds the AMQP
	// channels publishing at once, each carrying one message at a time
	// (16 when 0; must be >= 0); a Publish beyond them
	// waits for one. Publish.Transactional and Publish.Immediate are refused:
	// a channel in confirm mode cannot be transactional, and RabbitMQ does
	// not implement immediate.
	AMQP amqp.Config
}

func (c *PublisherConfig) setDefaults() {
	if c.AMQP.Publish.ChannelPoolSize == 0 {
		c.AMQP.Publish.ChannelPoolSize = defaultPublishChannels
	}
	if c.AMQP.TopologyBuilder == nil {
		c.AMQP.TopologyBuilder = &amqp.DefaultTopologyBuilder{}
	}
}

// validate reports the first invalid field.
func (c PublisherConfig) validate() error {
	switch p := c.AMQP.Publish; {
	case p.ChannelPoolSize < 0:
		return fmt.Errorf("amqpsub: PublisherConfig.AMQP.Publish.ChannelPoolSize must be >= 0, got %d", p.ChannelPoolSize)
	case p.Transactional:
		return errors.New("amqpsub: PublisherConfig.AMQP.Publish.Transactional is not supported; the publisher waits for the broker's confirmation of every message")
	case p.Immediate:
		return errors.New("amqpsub: PublisherConfig.AMQP.Publish.Immediate is not supported (RabbitMQ refuses it)")
	case c.AMQP.Connection.AmqpConfig != nil && c.AMQP.Connection.AmqpConfig.Recovery != nil:
		return errors.New("amqpsub: PublisherConfig.AMQP.Connection.AmqpConfig.Recovery is not supported; the publisher reconnects by itself (Connection.Reconnect)")
	}
	if err := c.AMQP.ValidatePublisher(); err != nil {
		return fmt.Errorf("amqpsub: PublisherConfig.AMQP: %w", err)
	}
	return nil
}

// Publisher is a Watermill publisher for RabbitMQ whose Publish returns nil
// only for messages that the broker both routed to a queue and confirmed:
// each message is published with the mandatory flag on a channel in confirm
// mode, and a message the broker returns (no queue bound for its routing
// key) is an error wrapping ErrUnroutable, one it does not confirm an error
// wrapping ErrNotConfirmed. watermill-amqp's Publisher, even with
// Publish.Mandatory and Publish.ConfirmDelivery, does not listen for the
// broker's returns and reports such a message as published.
//
// A channel carries one message at a time: RabbitMQ sends a returned
// message's basic.return before its basic.ack on the same channel, so the
// return that has arrived when the confirmation comes is that message's.
// Publish is safe for concurrent use; concurrent publishes use channels of
// their own, up to Config.AMQP.Publish.ChannelPoolSize. The messages of one
// Publish call are published one after the other, each confirmed before the
// next, and the first that fails ends the call.
type Publisher struct {
	cfg    PublisherConfig
	conn   *conn
	logger watermill.LoggerAdapter
	slots  chan struct{} // one per channel that may publish at once
	stop   chan struct{} // closed by Close

	mu       sync.Mutex
	closed   bool
	idle     []*pubChannel
	declared map[string]*amqp091.Connection // topic -> the connection on which its exchange was declared
	busy     sync.WaitGroup                 // calls of Publish and SubscribeInitialize in progress
	closing  sync.WaitGroup                 // channels being closed
}

// pubChannel is one confirm-mode channel and its notifications.
type pubChannel struct {
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	returns chan amqp091.Return
	closes  chan *amqp091.Error
}

// NewPublisher connects to the broker and returns a publisher that owns the
// connection (Close closes it). logger may be nil.
func NewPublisher(cfg PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	conn, err := dialConn(cfg.AMQP.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("amqpsub: %w", err)
	}
	return &Publisher{
		cfg: cfg, conn: conn, logger: logger,
		slots: make(chan struct{}, cfg.AMQP.Publish.ChannelPoolSize), stop: make(chan struct{}),
		declared: map[string]*amqp091.Connection{},
	}, nil
}

// Publish publishes msgs to topic's exchange (Exchange.GenerateName) with
// topic's routing key (Publish.GenerateRoutingKey), one after the other,
// and returns once the broker has confirmed each, or at the first that
// failed: an error wrapping ErrUnroutable for a message routed to no queue,
// ErrNotConfirmed for one not confirmed. The messages before it are
// published. A message's context bounds the wait for a channel and for its
// confirmation. While the connection is down Publish fails at once.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.enter(); err != nil {
		return err
	}
	defer p.busy.Done()
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	select {
	case p.slots <- struct{}{}:
	case <-p.stop:
		return errors.New("amqpsub: publisher is closed")
	case <-ctx.Done():
		return fmt.Errorf("amqpsub: publish to %q: waiting for a channel: %w", topic, ctx.Err())
	}
	defer func() { <-p.slots }()
	exchange, key := p.cfg.AMQP.Exchange.GenerateName(topic), p.cfg.AMQP.Publish.GenerateRoutingKey(topic)
	var pc *pubChannel
	for _, msg := range msgs {
		if pc == nil {
			var err error
			if pc, err = p.channel(); err != nil {
				return fmt.Errorf("amqpsub: publish to %q: %w", topic, err)
			}
			if err := p.declareExchange(pc, topic); err != nil {
				p.discard(pc)
				return fmt.Errorf("amqpsub: publish to %q: %w", topic, err)
			}
		}
		reusable, err := p.publish(pc, exchange, key, msg)
		if !reusable {
			p.discard(pc)
			pc = nil
		}
		if err != nil {
			if pc != nil {
				p.release(pc)
			} else {
				p.forget(topic)
			}
			return fmt.Errorf("amqpsub: publish to %q: %w", topic, err)
		}
	}
	if pc != nil {
		p.release(pc)
	}
	return nil
}

// publish sends one message on pc and waits for its confirmation. reusable
// says whether pc can carry another message: not when a confirmation is
// still to come on it, or the channel failed.
func (p *Publisher) publish(pc *pubChannel, exchange, key string, msg *message.Message) (reusable bool, err error) {
	amqpMsg, err := p.cfg.AMQP.Marshaler.Marshal(msg)
	if err != nil {
		return true, fmt.Errorf("marshal message %s: %w", msg.UUID, err)
	}
	ctx := msg.Context()
	select {
	case <-pc.returns: // none can be left (a channel is reused only after a clean confirmation); if one were, it is not this message's
	default:
	}
	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, amqpMsg)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return true, fmt.Errorf("message %s: %w", msg.UUID, err) // nothing was sent
		}
		return false, fmt.Errorf("message %s: %w: %w", msg.UUID, ErrNotConfirmed, errors.Join(err, closeReason(pc)))
	}
	if dc == nil { // the channel is not in confirm mode: cannot happen
		return false, fmt.Errorf("message %s: %w: the channel is not in confirm mode", msg.UUID, ErrNotConfirmed)
	}
	select {
	case <-dc.Done():
	case <-ctx.Done():
		return false, fmt.Errorf("message %s: %w: %w", msg.UUID, ErrNotConfirmed, ctx.Err())
	case <-p.stop:
		return false, fmt.Errorf("message %s: %w: the publisher was closed", msg.UUID, ErrNotConfirmed)
	}
	if !dc.Acked() {
		if reason := closeReason(pc); reason != nil {
			return false, fmt.Errorf("message %s: %w: %w", msg.UUID, ErrNotConfirmed, reason)
		}
		if pc.ch.IsClosed() {
			return false, fmt.Errorf("message %s: %w: the channel was closed", msg.UUID, ErrNotConfirmed)
		}
		// Not reused: nothing says a return could not follow.
		return false, fmt.Errorf("message %s: %w: the broker refused it (basic.nack)", msg.UUID, ErrNotConfirmed)
	}
	// The connection's reader hands a basic.return to pc.returns before it
	// dispatches the basic.ack that follows it: if this message was
	// returned, its return is there now.
	select {
	case r, ok := <-pc.returns:
		if !ok { // the channel closed after the ack; the message was routed
			return false, nil
		}
		return true, fmt.Errorf("message %s: %w: exchange %q, routing key %q: %d %s",
			msg.UUID, ErrUnroutable, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
	default:
		return true, nil
	}
}

// closeReason is the error with which pc's channel was closed, if it was.
func closeReason(pc *pubChannel) error {
	select {
	case e, ok := <-pc.closes:
		if ok && e != nil {
			return e
		}
		if !ok {
			return amqp091.ErrClosed
		}
	default:
	}
	return nil
}

// channel returns an idle channel of the current connection, or opens one.
func (p *Publisher) channel() (*pubChannel, error) {
	c, _ := p.conn.current()
	if c == nil {
		return nil, errors.New("not connected to AMQP")
	}
	p.mu.Lock()
	for len(p.idle) > 0 {
		pc := p.idle[len(p.idle)-1]
		p.idle = p.idle[:len(p.idle)-1]
		if pc.conn == c && !pc.ch.IsClosed() {
			p.mu.Unlock()
			return pc, nil
		}
		p.discardLocked(pc)
	}
	p.mu.Unlock()
	ch, err := c.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	pc := &pubChannel{
		conn:    c,
		ch:      ch,
		returns: ch.NotifyReturn(make(chan amqp091.Return, 1)),
		closes:  ch.NotifyClose(make(chan *amqp091.Error, 1)),
	}
	if err := ch.Confirm(false); err != nil {
		p.discard(pc)
		return nil, fmt.Errorf("put the channel in confirm mode: %w", err)
	}
	return pc, nil
}

// release puts pc back among the idle channels.
func (p *Publisher) release(pc *pubChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.discardLocked(pc)
		return
	}
	p.idle = append(p.idle, pc)
}

// discard closes pc in the background: closing waits for the broker's
// answer, and the channel may have a confirmation still to come.
func (p *Publisher) discard(pc *pubChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.discardLocked(pc)
}

func (p *Publisher) discardLocked(pc *pubChannel) {
	p.closing.Add(1)
	go func() {
		defer p.closing.Done()
		_ = pc.ch.Close()
	}()
}

// declareExchange declares topic's exchange on pc, once per connection, as
// watermill-amqp's Publisher does. The default exchange ("") is not
// declared.
func (p *Publisher) declareExchange(pc *pubChannel, topic string) error {
	name := p.cfg.AMQP.Exchange.GenerateName(topic)
	if name == "" {
		return nil
	}
	p.mu.Lock()
	done := p.declared[topic] == pc.conn
	p.mu.Unlock()
	if done {
		return nil
	}
	if err := p.cfg.AMQP.TopologyBuilder.ExchangeDeclare(pc.ch, name, p.cfg.AMQP); err != nil {
		return fmt.Errorf("declare exchange %q: %w", name, err)
	}
	p.mu.Lock()
	p.declared[topic] = pc.conn
	p.mu.Unlock()
	return nil
}

// forget has topic's exchange declared again before the next message: a
// failed publish may be that of an exchange deleted since.
func (p *Publisher) forget(topic string) {
	p.mu.Lock()
	delete(p.declared, topic)
	p.mu.Unlock()
}

// SubscribeInitialize declares the topology of topic as a subscriber with
// the same configuration would (queue, exchange, binding; see
// amqp.TopologyBuilder), so that the messages published to topic have a
// queue to go to: the publisher can be middleware.ParkConfig.Initializer.
// It needs Config.AMQP.Queue.GenerateName.
func (p *Publisher) SubscribeInitialize(topic string) (err error) {
	if err := p.enter(); err != nil {
		return err
	}
	defer p.busy.Done()
	a := p.cfg.AMQP
	if a.Queue.GenerateName == nil {
		return fmt.Errorf("amqpsub: declare %q: PublisherConfig.AMQP.Queue.GenerateName is nil, no queue to declare", topic)
	}
	params := amqp.BuildTopologyParams{Topic: topic, QueueName: a.Queue.GenerateName(topic), ExchangeName: a.Exchange.GenerateName(topic)}
	if a.QueueBind.GenerateRoutingKey != nil {
		params.RoutingKey = a.QueueBind.GenerateRoutingKey(topic)
	}
	c, _ := p.conn.current()
	if c == nil {
		return fmt.Errorf("amqpsub: declare %q: not connected to AMQP", topic)
	}
	ch, err := c.Channel()
	if err != nil {
		return fmt.Errorf("amqpsub: declare %q: open channel: %w", topic, err)
	}
	defer func() { err = errors.Join(err, ignoreClosed(ch.Close())) }()
	if err := a.TopologyBuilder.BuildTopology(ch, params, a, p.logger); err != nil {
		return fmt.Errorf("amqpsub: declare %q: %w", topic, err)
	}
	return nil
}

// enter counts a call of Publish or SubscribeInitialize in p.busy, which
// Close waits for, or refuses it once p is closed. The caller calls
// p.busy.Done when it returns.
func (p *Publisher) enter() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("amqpsub: publisher is closed")
	}
	p.busy.Add(1)
	return nil
}

// Close stops publishing: a Publish still waiting for a confirmation
// returns an error wrapping ErrNotConfirmed. It then closes the connection.
// Close is safe to call more than once.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.stop)
	p.mu.Unlock()
	p.busy.Wait()
	p.mu.Lock()
	p.idle = nil // closed with the connection
	p.mu.Unlock()
	err := p.conn.close()
	p.closing.Wait()
	return err
}

// Interface checks.
var (
	_ message.Publisher            = (*Publisher)(nil)
	_ message.SubscribeInitializer = (*Publisher)(nil)
)
