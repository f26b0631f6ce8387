package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// defaultInFlight is Config.InFlight when it is not set.
const defaultInFlight = 16

// Config configures a Subscriber.
type Config struct {
	// AMQP is watermill-amqp's configuration, used as its own Subscriber
	// uses it: the connection and its reconnection backoff
	// (Connection.Reconnect; amqp091's Connection.AmqpConfig.Recovery is
	// refused, the subscriber dials again by itself), the queue, exchange
	// and binding names, the topology, the consume options and the
	// marshaler.
	// A Consume.Qos.PrefetchCount below InFlight (watermill-amqp's
	// configurations set 1; 0, unlimited, counts as not set) is raised to
	// 4 × InFlight: the broker sends no more unacked deliveries than the
	// prefetch, and a few more than InFlight have the next deliveries
	// already on the client when the ones in flight are acked.
	AMQP amqp.Config
	// InFlight is how many deliveries of one subscription are handed to
	// the router at once, before any of them is acked. Defaults to
	// 16; at most 65535, the largest prefetch AMQP can set.
	InFlight int
}

// Subscriber is a Watermill subscriber for RabbitMQ that keeps up to
// Config.InFlight deliveries of each subscription unacked in the router at
// once, on one AMQP channel, and acks them in as few frames as it can. See
// the package documentation.
type Subscriber struct {
	cfg    Config
	conn   *conn
	logger watermill.LoggerAdapter

	mu     sync.Mutex
	closed bool
	stop   chan struct{} // closed by Close
	subs   sync.WaitGroup
}

// NewSubscriber connects to the broker and returns a subscriber that owns
// the connection (Close closes it). logger may be nil.
func NewSubscriber(cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	// basic.qos carries the prefetch count in 16 bits.
	if cfg.InFlight < 0 || cfg.InFlight > math.MaxUint16 {
		return nil, fmt.Errorf("amqpsub: Config.InFlight must be in [0, %d], got %d", math.MaxUint16, cfg.InFlight)
	}
	if q := cfg.AMQP.Consume.Qos.PrefetchCount; q < 0 || q > math.MaxUint16 {
		return nil, fmt.Errorf("amqpsub: Config.AMQP.Consume.Qos.PrefetchCount must be in [0, %d], got %d", math.MaxUint16, q)
	}
	if cfg.AMQP.Connection.AmqpConfig != nil && cfg.AMQP.Connection.AmqpConfig.Recovery != nil {
		// amqp091 would recover the connection in place, under the
		// subscriber's own reconnection and its delivery tags.
		return nil, errors.New("amqpsub: Config.AMQP.Connection.AmqpConfig.Recovery is not supported; the subscriber reconnects by itself (Connection.Reconnect)")
	}
	if cfg.InFlight == 0 {
		cfg.InFlight = defaultInFlight
	}
	if cfg.AMQP.Consume.Qos.PrefetchCount < cfg.InFlight {
		cfg.AMQP.Consume.Qos.PrefetchCount = min(4*cfg.InFlight, math.MaxUint16)
	}
	if err := cfg.AMQP.ValidateSubscriber(); err != nil {
		return nil, fmt.Errorf("amqpsub: %w", err)
	}
	conn, err := dialConn(cfg.AMQP.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("amqpsub: %w", err)
	}
	return &Subscriber{cfg: cfg, conn: conn, logger: logger, stop: make(chan struct{})}, nil
}

// InFlight returns how many deliveries of one subscription the router may
// hold at once (Config.InFlight). pipeline reads it to size batches.
func (s *Subscriber) InFlight() int { return s.cfg.InFlight }

// Subscribe starts consuming topic's queue and returns its messages. The
// channel is closed when the subscriber is closed or ctx is done. A lost
// connection or channel is opened again (the connection with the backoff of
// Connection.Reconnect); the deliveries that were in flight on the lost
// channel are redelivered by the broker, whatever their handlers return,
// and their messages' contexts are cancelled.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errors.New("amqpsub: subscriber is closed")
	}
	c := &consumer{
		s:      s,
		params: s.params(topic),
		fields: watermill.LogFields{"topic": topic},
		out:    make(chan *message.Message),
	}
	if err := s.prepare(c.params); err != nil {
		return nil, fmt.Errorf("amqpsub: prepare consume of %q: %w", topic, err)
	}
	s.subs.Add(1)
	go func() {
		defer s.subs.Done()
		c.run(ctx)
	}()
	return c.out, nil
}

// SubscribeInitialize declares the topology of topic (queue, exchange,
// binding) without consuming.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("amqpsub: subscriber is closed")
	}
	if err := s.prepare(s.params(topic)); err != nil {
		return fmt.Errorf("amqpsub: prepare consume of %q: %w", topic, err)
	}
	return nil
}

// Close stops every subscription, closes their message channels and then the
// connection. Deliveries that were not acked yet go back to the queue.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.stop)
	s.mu.Unlock()
	s.subs.Wait()
	return s.conn.close()
}

func (s *Subscriber) params(topic string) amqp.BuildTopologyParams {
	return amqp.BuildTopologyParams{
		Topic:        topic,
		QueueName:    s.cfg.AMQP.Queue.GenerateName(topic),
		ExchangeName: s.cfg.AMQP.Exchange.GenerateName(topic),
		RoutingKey:   s.cfg.AMQP.QueueBind.GenerateRoutingKey(topic),
	}
}

// prepare declares the topology on a channel of its own.
func (s *Subscriber) prepare(p amqp.BuildTopologyParams) (err error) {
	ch, err := s.channel()
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, ignoreClosed(ch.Close())) }()
	return s.cfg.AMQP.TopologyBuilder.BuildTopology(ch, p, s.cfg.AMQP, s.logger)
}

// channel opens a channel with the configured QoS.
func (s *Subscriber) channel() (*amqp091.Channel, error) {
	c, _ := s.conn.current()
	if c == nil {
		return nil, errors.New("not connected to AMQP")
	}
	ch, err := c.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	q := s.cfg.AMQP.Consume.Qos
	if err := ch.Qos(q.PrefetchCount, q.PrefetchSize, q.Global); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("set QoS: %w", err)
	}
	return ch, nil
}

func ignoreClosed(err error) error {
	if errors.Is(err, amqp091.ErrClosed) {
		return nil
	}
	return err
}

// consumer is one subscription: it consumes on one channel at a time and
// opens another when that one is lost.
type consumer struct {
	s      *Subscriber
	params amqp.BuildTopologyParams
	fields watermill.LogFields
	out    chan *message.Message
}

// reopenDelay is how long a consumer waits before it opens a channel again
// after losing one.
const reopenDelay = 100 * time.Millisecond

func (c *consumer) run(ctx context.Context) {
	defer close(c.out)
	for first := true; ; first = false {
		_, up := c.s.conn.current()
		select {
		case <-up:
			if !first {
				// Before a new session: the topology may be gone with
				// the broker (a non-durable queue), so it is declared
				// again.
				if err := c.s.prepare(c.params); err != nil {
					c.s.logger.Error("amqpsub: prepare consume", err, c.fields)
				}
			}
			c.session(ctx)
		case <-c.s.stop:
			return
		case <-ctx.Done():
			return
		}
		select {
		case <-c.s.stop:
			return
		case <-ctx.Done():
			return
		case <-time.After(reopenDelay):
		}
	}
}

// result is what the router said of one delivery.
type result struct {
	tag uint64
	ack bool
}

// session consumes on one channel until it is lost, the subscriber closes
// or ctx is done. It returns once every goroutine it started has ended.
func (c *consumer) session(ctx context.Context) {
	ch, err := c.s.channel()
	if err != nil {
		c.s.logger.Error("amqpsub: open consume channel", err, c.fields)
		return
	}
	lost := ch.NotifyClose(make(chan *amqp091.Error, 1))
	cc := c.s.cfg.AMQP.Consume
	deliveries, err := ch.Consume(c.params.QueueName, cc.Consumer, false, cc.Exclusive, cc.NoLocal, cc.NoWait, cc.Arguments)
	if err != nil {
		c.s.logger.Error("amqpsub: consume", err, c.fields)
		_ = ch.Close()
		return
	}
	c.s.logger.Info("amqpsub: consuming", c.fields)

	done := make(chan struct{}) // closed when the session ends
	var wg sync.WaitGroup
	a := &acker{ch: ch, requeue: !cc.NoRequeueOnNack, spill: c.s.cfg.InFlight,
		results: make(chan result, c.s.cfg.InFlight), msgs: map[uint64]*message.Message{}}
	slots := make(chan struct{}, c.s.cfg.InFlight)
	finish, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		a.run(finish)
	}()
	// quit is closed when the session must end: the channel is lost, the
	// subscriber closes or ctx is done.
	quit := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(quit)
		select {
		case err := <-lost:
			if err != nil { // nil when it was closed without an error
				c.s.logger.Error("amqpsub: channel closed", err, c.fields)
			}
		case <-c.s.stop:
		case <-ctx.Done():
		case <-done:
		}
	}()
	defer func() {
		// What was answered is settled with the broker first; closing the
		// channel then hands every delivery not acked back to it, and the
		// goroutines of the ones still in the router end with done.
		close(finish)
		<-finished
		close(done)
		_ = ch.Close()
		wg.Wait()
	}()

	for {
		var d amqp091.Delivery
		var ok bool
		select {
		case d, ok = <-deliveries:
			if !ok {
				return // the channel or the connection is gone
			}
		case <-quit:
			return
		}
		msg, err := c.s.cfg.AMQP.Marshaler.Unmarshal(d)
		if err != nil {
			// As watermill-amqp does: the delivery cannot become a message.
			c.s.logger.Error("amqpsub: unmarshal", err, c.fields)
			a.nackNow(d.DeliveryTag)
			continue
		}
		if d.Redelivered {
			msg.Metadata.Set(amqp.MetadataRedeliveredKey, "true")
		}
		// A slot first: no more than InFlight deliveries of this channel
		// in the router. (Each wait looks at quit first: a select picks
		// at random among the cases that are ready.)
		if ended(quit) {
			return
		}
		select {
		case slots <- struct{}{}:
		case <-quit:
			return
		}
		mctx, cancel := context.WithCancel(ctx)
		msg.SetContext(mctx)
		a.delivered(d.DeliveryTag, msg)
		if ended(quit) {
			cancel()
			return
		}
		select {
		case c.out <- msg:
		case <-quit:
			cancel() // not handed over: the broker delivers it again
			return
		}
		wg.Add(1)
		go func(tag uint64) {
			defer wg.Done()
			defer cancel()
			var r result
			select {
			case <-msg.Acked():
				r = result{tag: tag, ack: true}
			case <-msg.Nacked():
				r = result{tag: tag}
			case <-done:
				return // the channel is gone: the broker redelivers it
			}
			<-slots
			select {
			case a.results <- r:
			case <-done:
			}
		}(d.DeliveryTag)
	}
}

// acker acks and nacks the deliveries of one channel. A nack is sent at
// once. Acks are sent in the order the deliveries arrived, so that a run of
// acked ones at the head is one frame (multiple=true up to the last of the
// run), which covers no delivery that is not answered: one acked behind an
// unanswered delivery waits for it, for maxAckHold at most and not at all
// when spill or more deliveries are waiting to be settled; then each acked
// one is sent on its own, so that a slow message holds back neither the
// broker (which stops sending once its prefetch is used up) nor the acks of
// the others.
type acker struct {
	ch      *amqp091.Channel
	requeue bool
	spill   int // pending deliveries from which acks behind the head go one by one
	results chan result

	mu      sync.Mutex
	pending []uint64                    // delivery tags handed to the router, in order, not yet settled with the broker
	msgs    map[uint64]*message.Message // the message of each pending tag
}

// delivered records a delivery handed to the router.
func (a *acker) delivered(tag uint64, msg *message.Message) {
	a.mu.Lock()
	a.pending = append(a.pending, tag)
	a.msgs[tag] = msg
	a.mu.Unlock()
}

// nackNow nacks a delivery that never reached the router.
func (a *acker) nackNow(tag uint64) {
	_ = a.ch.Nack(tag, false, a.requeue)
}

// run settles answers as they come until finish is closed, then once more
// with what has come by then, sending every ack that is still held.
func (a *acker) run(finish <-chan struct{}) {
	answered := map[uint64]bool{} // tag -> acked, for tags not yet settled
	hold := time.NewTimer(maxAckHold)
	hold.Stop()
	holding := false // hold runs: acks are held behind an unanswered delivery
	defer hold.Stop()
	for last := false; !last; {
		all := false // send the held acks too
		select {
		case r := <-a.results:
			answered[r.tag] = r.ack
		case <-hold.C:
			holding, all = false, true
		case <-finish:
			last, all = true, true
		}
		// Whatever else has been answered meanwhile goes in the same pass.
	more:
		for {
			select {
			case r := <-a.results:
				answered[r.tag] = r.ack
			default:
				break more
			}
		}
		if last {
			// The router may have answered messages whose goroutines have
			// not reported yet: what it answered before the end is settled
			// too, not handed back.
			a.sweep(answered)
		}
		if err := a.settle(answered, all); err != nil {
			// The channel is failing; the session ends on its close
			// notification and the broker redelivers what was not acked.
			return
		}
		// What is left in answered are acks held behind an unanswered
		// delivery: they wait for it at most maxAckHold.
		if len(answered) > 0 && !holding {
			hold.Reset(maxAckHold)
			holding = true
		}
	}
}

// maxAckHold is the longest an ack waits behind an unanswered delivery for
// the two to go in one frame. Past it the ack goes on its own: a message
// the router has finished must not be delivered again because a slow one
// before it was still running when the channel was lost.
const maxAckHold = 10 * time.Millisecond

// sweep adds to answered the pending messages that the router has acked or
// nacked.
func (a *acker) sweep(answered map[uint64]bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, tag := range a.pending {
		if _, ok := answered[tag]; ok {
			continue
		}
		select {
		case <-a.msgs[tag].Acked():
			answered[tag] = true
		case <-a.msgs[tag].Nacked():
			answered[tag] = false
		default:
		}
	}
}

// settle sends the frames for the answered deliveries: every nack, the
// run of acks at the head of pending, and the other acks when all is set or
// spill or more deliveries are pending.
func (a *acker) settle(answered map[uint64]bool, all bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	// Nacks go at once, wherever they are: an ack of several deliveries
	// sent later passes over them, as they are no longer outstanding.
	if err := a.settleEach(answered, false); err != nil {
		return err
	}
	var run uint64 // the last tag of the run of acked deliveries at the head
	for len(a.pending) > 0 {
		tag := a.pending[0]
		if _, ok := answered[tag]; !ok {
			break
		}
		a.forget(answered, tag)
		a.pending = a.pending[1:]
		run = tag
	}
	if run != 0 {
		if err := a.ch.Ack(run, true); err != nil {
			return err
		}
	}
	if all || len(a.pending) >= a.spill {
		return a.settleEach(answered, true)
	}
	return nil
}

// settleEach sends a frame of its own for each pending delivery answered
// with ack, and takes it out of pending.
func (a *acker) settleEach(answered map[uint64]bool, ack bool) error {
	keep := a.pending[:0]
	for i, tag := range a.pending {
		if acked, ok := answered[tag]; !ok || acked != ack {
			keep = append(keep, tag)
			continue
		}
		a.forget(answered, tag)
		var err error
		if ack {
			err = a.ch.Ack(tag, false)
		} else {
			err = a.ch.Nack(tag, false, a.requeue)
		}
		if err != nil {
			a.pending = append(keep, a.pending[i+1:]...)
			return err
		}
	}
	a.pending = keep
	return nil
}

// forget drops what is kept of a settled delivery.
func (a *acker) forget(answered map[uint64]bool, tag uint64) {
	delete(answered, tag)
	delete(a.msgs, tag)
}

// ended reports whether ch is closed, without waiting.
func ended(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
