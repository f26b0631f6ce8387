package natsjs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/settle-go/settle/internal/settlement"
)

// Config configures a Subscriber. Durable is required; every other field has
// a default that settle's guarantees hold with.
type Config struct {
	// Durable names the JetStream durable consumer of each topic (Durable,
	// "_", the topic with '.', '*', '>' and spaces made '_') and the queue
	// group its subscriptions join. Every subscription with the same Durable
	// on a topic, in this process or another, takes its share of the
	// topic's messages (competing consumers), and a process that restarts
	// resumes from the first message not acked (Subscribe creates the
	// consumer, which outlives the subscriptions). Required; letters,
	// digits, '-' and '_' only.
	Durable string

	// AckWait is how long JetStream waits for the ack of a delivery before it
	// delivers the message again (the consumer's AckWait). The subscriber
	// itself waits for the router's answer without end. It bounds how soon
	// the message of a consumer that died comes back; a handler that runs
	// longer than AckWait has its message delivered again while it runs (see
	// the package documentation). Keep it longer than the longest handler
	// and at least the dedupe claim timeout (pipeline.Config.ClaimTimeout,
	// 30s by default). Defaults to 30s. Must be >= 1s.
	AckWait time.Duration

	// NakDelay is how long JetStream holds a nacked delivery before it
	// delivers the message again (NakWithDelay). The retry middleware, told
	// of it on every message, nacks that much sooner than its
	// RedeliveryDelay (at once with the defaults, both 1s), so that a failed
	// delivery frees its router slot while it waits. Defaults to 1s;
	// settle.NoDelay for none. Must be >= 0 or settle.NoDelay.
	NakDelay time.Duration

	// SubscribersCount is how many subscriptions each Subscribe opens on
	// the consumer, each handing the router one delivery at a time: how
	// many deliveries of one handler are in flight at once (Subscriber's
	// InFlight, which sizes pipeline's batches). Defaults to 1. Must be >= 0
	// (0 means 1).
	SubscribersCount int

	// MaxAckPending is the most messages JetStream has delivered to the
	// durable consumer and not yet had acked, across every process that
	// shares it (the consumer's MaxAckPending). It must cover the deliveries
	// in flight and the failed ones waiting out NakDelay, which JetStream
	// counts as pending until it delivers them again: with MaxAckPending 1,
	// one failed message stops its consumer for NakDelay. A delivery beyond
	// the free subscriptions waits in its subscriber's buffer, with its
	// AckWait running, where no other subscription can take it: with a
	// backlog, the first subscription to join takes up to MaxAckPending
	// messages at once and handles them one by one (with 64, all 64 of a
	// test's backlog, and batches of one). Every process of a Durable must
	// give the same value (JetStream refuses a subscription whose value
	// differs from the consumer's). Defaults to 4 times SubscribersCount;
	// with several processes, or several Subscribe calls on a topic
	// (pipeline.Config.Concurrency), set 4 times all their subscriptions
	// together. Must be >= 0 (0 means its default).
	MaxAckPending int

	// AckAsync sends each ack without waiting for JetStream to confirm it
	// (watermill-nats' JetStreamConfig.AckAsync), so a subscription takes
	// its next message one round trip sooner: measured (bench, section nats)
	// about twice the rate at 16 in flight. An ack lost on the way is a
	// redelivery: acked as a duplicate where a dedupe store keeps the key,
	// run again where none does. Defaults to false: each ack is confirmed.
	AckAsync bool

	// NatsOptions are passed to nats.Connect (credentials, TLS, reconnect
	// settings), after nats.MaxReconnects(-1): nats.go gives up a lost
	// connection after 60 tries by default (about two minutes), and the
	// subscriber would then stay silent for good while the server is back.
	// Defaults to none.
	NatsOptions []nats.Option

	// Unmarshaler decodes a NATS message into a Watermill message before
	// settle adds the delivery's facts (see the package documentation).
	// Defaults to reading what watermill-nats' NATSMarshaler writes, and
	// never failing: a header with several values keeps its first. A
	// delivery this Unmarshaler refuses is left unanswered by watermill-nats
	// and never reaches settle (whose poison parking would set it aside):
	// JetStream delivers it again after every AckWait, without end. Prefer
	// one that never fails.
	Unmarshaler wmnats.Unmarshaler
}

func (c *Config) setDefaults() {
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	c.NakDelay = settlement.Delay(c.NakDelay, time.Second)
	if c.SubscribersCount == 0 {
		c.SubscribersCount = 1
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = 4 * c.SubscribersCount
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
	switch {
	case c.Durable == "":
		return errors.New("natsjs: Config.Durable is required")
	case strings.IndexFunc(c.Durable, func(r rune) bool {
		return !(r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
	}) >= 0:
		return fmt.Errorf("natsjs: Config.Durable must hold only letters, digits, '-' and '_', got %q", c.Durable)
	case c.AckWait < time.Second:
		return fmt.Errorf("natsjs: Config.AckWait must be >= 1s, got %v", c.AckWait)
	case c.NakDelay < 0:
		return fmt.Errorf("natsjs: Config.NakDelay must be >= 0 or settle.NoDelay, got %v", c.NakDelay)
	case c.SubscribersCount < 0:
		return fmt.Errorf("natsjs: Config.SubscribersCount must be >= 0, got %d", c.SubscribersCount)
	case c.MaxAckPending < 0:
		return fmt.Errorf("natsjs: Config.MaxAckPending must be >= 0, got %d", c.MaxAckPending)
	}
	return nil
}

// durableName is the consumer of topic: Durable, "_", and the topic with
// the characters a consumer name cannot hold made '_'.
func durableName(prefix, topic string) string {
	return prefix + "_" + strings.Map(func(r rune) rune {
		switch r {
		case '.', '*', '>', ' ', '\t', '\n', '\r':
			return '_'
		}
		return r
	}, topic)
}

// routerWait is how long watermill-nats waits for the router to ack or nack
// a delivery (its AckWaitTimeout): without end. When it stops waiting it
// cancels the message's context, which stops the dedupe middleware's claim
// renewals: a handler still running would lose its claim one ClaimTimeout
// later, and the next delivery would run it again beside it. The router
// answers every delivery it took (on Close too, by its context), so the wait
// ends; JetStream's own AckWait still brings the message of a dead consumer
// back.
const routerWait = time.Duration(math.MaxInt64)

// subscriberConfig is watermill-nats' configuration for cfg.
func subscriberConfig(url string, cfg Config) wmnats.SubscriberConfig {
	// Clipped, so that the appends watermill-nats makes to it for each
	// subscription never share a backing array.
	opts := slices.Clip([]nats.SubOpt{
		// Without it nats.go acks every delivery when watermill-nats'
		// callback returns, which it does when it stops waiting for the
		// router (on Close, or when the subscription's context ends): a
		// message the router never finished would be acked, and lost.
		nats.ManualAck(),
		nats.AckExplicit(),
		nats.AckWait(cfg.AckWait),
		nats.MaxAckPending(cfg.MaxAckPending),
	})
	var nak wmnats.Delay
	if cfg.NakDelay > 0 {
		nak = wmnats.NewStaticDelay(cfg.NakDelay)
	}
	return wmnats.SubscriberConfig{
		URL:              url,
		QueueGroupPrefix: cfg.Durable,
		SubscribersCount: cfg.SubscribersCount,
		AckWaitTimeout:   routerWait,
		NatsOptions:      cfg.NatsOptions,
		Unmarshaler:      unmarshaler{inner: cfg.Unmarshaler, nakDelay: cfg.NakDelay},
		NakDelay:         nak,
		JetStream: wmnats.JetStreamConfig{
			SubscribeOptions:  opts,
			AckAsync:          cfg.AckAsync,
			DurablePrefix:     cfg.Durable,
			DurableCalculator: durableName,
		},
	}
}

// Subscriber is watermill-nats' JetStream subscriber configured for settle
// (see Config and the package documentation), with InFlight, and a
// SubscribeInitialize that checks for a stream instead of creating one.
// It is safe for concurrent use. Close closes its connection.
type Subscriber struct {
	sub      *wmnats.Subscriber
	conn     *nats.Conn
	js       nats.JetStreamContext
	cfg      Config
	inFlight int
	ackWait  time.Duration

	closeOnce sync.Once
	closeErr  error
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber connects to the NATS server at url and returns a Subscriber
// configured by cfg, or an error naming the bad field of cfg. A nil logger
// means watermill.NopLogger.
func NewSubscriber(url string, cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	wcfg := subscriberConfig(url, cfg)
	conn, err := nats.Connect(url, append([]nats.Option{nats.MaxReconnects(-1)}, cfg.NatsOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("natsjs: connect: %w", err)
	}
	js, err := conn.JetStream()
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	sub, err := wmnats.NewSubscriberWithNatsConn(conn, wcfg.GetSubscriberSubscriptionConfig(), logger)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	return &Subscriber{sub: sub, conn: conn, js: js, cfg: cfg, inFlight: cfg.SubscribersCount, ackWait: cfg.AckWait}, nil
}

// Subscribe subscribes to topic through the durable consumer of
// Config.Durable, creating it first if it does not exist, in the stream
// whose subjects take topic. It fails when no stream takes topic, or when
// the consumer exists with other settings (another AckWait, MaxAckPending or
// queue group).
//
// The consumer is created here, not by nats.go: nats.go deletes a consumer
// it created when the subscription that created it ends, so the first
// process of a Durable to shut down would delete the consumer of every
// other, with its place in the stream (the next one would start over from
// the stream's first message). A consumer created here outlives every
// subscription; delete it when the Durable is retired. A consumer created
// beforehand by other means is used if its settings match: push, deliver
// group Durable, explicit acks, the AckWait and MaxAckPending of Config.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.ensureConsumer(topic); err != nil {
		return nil, err
	}
	return s.sub.Subscribe(ctx, topic)
}

// ensureConsumer creates the durable consumer of topic unless it exists.
func (s *Subscriber) ensureConsumer(topic string) error {
	stream, err := s.js.StreamNameBySubject(topic)
	if err != nil {
		return fmt.Errorf("natsjs: no JetStream stream takes subject %q: %w", topic, err)
	}
	name := durableName(s.cfg.Durable, topic)
	if _, err := s.js.ConsumerInfo(stream, name); err == nil {
		return nil
	} else if !errors.Is(err, nats.ErrConsumerNotFound) {
		return fmt.Errorf("natsjs: consumer %s of stream %s: %w", name, stream, err)
	}
	_, err = s.js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable:        name,
		DeliverSubject: nats.NewInbox(),
		DeliverGroup:   s.cfg.Durable,
		DeliverPolicy:  nats.DeliverAllPolicy,
		FilterSubject:  topic,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        s.cfg.AckWait,
		MaxAckPending:  s.cfg.MaxAckPending,
	})
	if err != nil {
		// Another process may have created it at the same moment.
		if _, ierr := s.js.ConsumerInfo(stream, name); ierr == nil {
			return nil
		}
		return fmt.Errorf("natsjs: create consumer %s of stream %s: %w", name, stream, err)
	}
	return nil
}

// SubscribeInitialize checks that a stream takes the messages published to
// topic. It creates nothing: watermill-nats' own would create a stream named
// after the topic, which fails for a topic with a '.' (pipeline's default
// parking topics, "<topic>.dead_letter") and for one inside another
// stream's subjects. Create streams as the package documentation shows.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if _, err := s.js.StreamNameBySubject(topic); err != nil {
		return fmt.Errorf("natsjs: no JetStream stream takes subject %q: %w", topic, err)
	}
	return nil
}

// InFlight is how many deliveries of one subscription can be in the router
// at once: Config.SubscribersCount.
func (s *Subscriber) InFlight() int { return s.inFlight }

// AckWait is Config.AckWait: how long a delivery may stay unanswered before
// JetStream delivers it again. pipeline compares it with its claim timeout.
func (s *Subscriber) AckWait() time.Duration { return s.ackWait }

// Close closes every subscription, waiting for the deliveries in the router
// to be acked or nacked up to 30 seconds, and then the connection. Calls
// after the first wait for it and return its result.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.close() })
	return s.closeErr
}

func (s *Subscriber) close() error {
	closed := make(chan struct{})
	s.conn.SetClosedHandler(func(*nats.Conn) { close(closed) })
	err := s.sub.Close() // drains the connection, which then closes
	if err == nil && !s.conn.IsClosed() {
		t := time.NewTimer(drainWait)
		defer t.Stop()
		select {
		case <-closed:
		case <-t.C:
		}
	}
	s.conn.Close()
	return err
}

// drainWait bounds how long Close waits for the connection to drain.
const drainWait = 10 * time.Second
