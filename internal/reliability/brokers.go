package reliability

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/redissub"
)

// Each broker has two sides here. In the campaign's processes, one function
// (amqpPubSub, natsPubSub, redisPubSub) builds the publisher the relay
// forwards with and the consumers dead-letter with, and the consumers'
// subscriber: every setting the guarantee needs from that broker is in it.
// In the driver, a brokerAdmin creates the topic and its dead-letter and
// poison destinations, reports what is left on them, publishes a second
// delivery for FaultSIGSTOP and removes them at the end.

// pubSub opens the broker's publisher and, when withSub, the consumers'
// subscriber. The caller closes both.
func pubSub(spec childSpec, logger watermill.LoggerAdapter, withSub bool) (message.Publisher, message.Subscriber, error) {
	switch spec.Broker {
	case BrokerNATS:
		return natsPubSub(spec, logger, withSub)
	case BrokerRedis:
		return redisPubSub(spec, logger, withSub)
	default:
		return amqpPubSub(spec, logger, withSub)
	}
}

// amqpPubSub: watermill-amqp with publisher confirms and prefetch 8 per
// channel; in batch mode with OneSubscription, one amqpsub subscription with
// BatchSize deliveries in flight.
func amqpPubSub(spec childSpec, logger watermill.LoggerAdapter, withSub bool) (message.Publisher, message.Subscriber, error) {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return nil, nil, err
	}
	cfg := amqp.NewDurableQueueConfig(spec.AMQP)
	cfg.Marshaler = m
	cfg.Publish.ConfirmDelivery = true
	cfg.Consume.Qos.PrefetchCount = 8
	// Reconnect quickly after a broker restart; watermill-amqp's default
	// starts at 500ms and grows to 60s.
	cfg.Connection.Reconnect = &amqp.ReconnectConfig{
		BackoffInitialInterval:     100 * time.Millisecond,
		BackoffRandomizationFactor: 0.5,
		BackoffMultiplier:          1.5,
		BackoffMaxInterval:         2 * time.Second,
	}
	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil || !withSub {
		return pub, nil, err
	}
	var sub message.Subscriber
	if spec.OneSubscription {
		sub, err = amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg, InFlight: spec.BatchSize}, logger)
	} else {
		sub, err = amqp.NewSubscriber(cfg, logger)
	}
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	return pub, sub, nil
}

// natsAckWait is the JetStream consumer's AckWait: how long a delivery may
// stay unacked before the server sends it again, so how soon the deliveries
// of a killed consumer come back. Twice the claim timeout: a redelivery then
// finds the dead consumer's dedupe claim lapsed instead of busy, and a live
// handler slowed by the machine's load is not sent to the other consumer
// while it still holds its claim.
func natsAckWait(claimTimeout time.Duration) time.Duration { return 2 * claimTimeout }

// natsMaxAckPending bounds the deliveries the consumer has out unacked, in
// both processes together: a killed process holds its share until AckWait.
const natsMaxAckPending = 256

// natsDurable is the natsjs Durable of the campaign's consumers: their
// JetStream consumer of topic is natsConsumer(topic), created by the first
// subscriber (natsjs creates it itself, so that it outlives the
// subscriptions; nats.go would delete a consumer it created when the
// subscription that created it closes).
const natsDurable = "rel"

// natsConsumer is the name natsjs gives the durable consumer of topic.
func natsConsumer(topic string) string {
	return natsDurable + "_" + strings.NewReplacer(".", "_", "*", "_", ">", "_", " ", "_").Replace(topic)
}

// natsOptions makes a connection that reconnects without end, quickly, so
// that a process outlives a NATS restart (FaultNATS).
func natsOptions(name string) []nats.Option {
	return []nats.Option{nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(200 * time.Millisecond)}
}

// natsPubSub: watermill-nats on JetStream as settle's natsjs sets it up.
// The publisher waits for the stream's ack (a publish returns once the
// message is stored), with no TrackMsgId: the relay's second copy of a
// message (a kill between publish and mark) must reach the consumers, whose
// dedupe is what is tested. The subscriber is natsjs's: the durable
// consumer natsConsumer, delivered to a queue group, manual explicit acks
// (without nats.ManualAck, nats.go acks every delivery when watermill's
// callback returns, whatever the handler did), a wait for the router's
// answer without end, the delivery count and the broker's nack delay.
func natsPubSub(spec childSpec, logger watermill.LoggerAdapter, withSub bool) (message.Publisher, message.Subscriber, error) {
	pc := natsjs.NewPublisherConfig(spec.NATS)
	pc.NatsOptions = append(pc.NatsOptions, natsOptions(spec.Name)...)
	pub, err := natsjs.NewPublisher(pc, logger)
	if err != nil {
		return nil, nil, err
	}
	if !withSub {
		return pub, nil, nil
	}
	sub, err := natsjs.NewSubscriber(spec.NATS, natsjs.Config{
		Durable:       natsDurable,
		AckWait:       natsAckWait(spec.ClaimTimeout),
		MaxAckPending: natsMaxAckPending,
		NatsOptions:   natsOptions(spec.Name),
	}, logger)
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	return pub, sub, nil
}

// redisClaimInterval is how often a Redis consumer looks for deliveries
// left pending by a dead consumer, and redisMaxIdle how long one must have
// been pending before it is claimed: the claim timeout, so that a claimed
// delivery finds the dead consumer's dedupe claim lapsed or about to.
// watermill-redisstream's defaults (5s and 60s) would leave a killed
// consumer's deliveries away for a minute.
func redisClaimInterval(claimTimeout time.Duration) time.Duration { return claimTimeout / 4 }

func redisMaxIdle(claimTimeout time.Duration) time.Duration { return claimTimeout }

// redisPubSub: watermill-redisstream's publisher and settle's redissub
// subscriber. The subscriber reads in the consumer group named after the
// topic, as the consumer named after the process's role (a restarted
// process is the same consumer: what it had pending is claimed back like
// any other dead consumer's), claims deliveries pending for longer than
// redisMaxIdle every redisClaimInterval, and sets Redis's delivery count.
// It never deletes a consumer (watermill-redisstream's idle-consumer
// deletion can drop a live consumer's pending entries). Publisher and
// subscriber have a client each; the subscriber's is closed with it.
func redisPubSub(spec childSpec, logger watermill.LoggerAdapter, withSub bool) (message.Publisher, message.Subscriber, error) {
	opts, err := redis.ParseURL(spec.Redis)
	if err != nil {
		return nil, nil, fmt.Errorf("reliability: redis URL: %w", err)
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, logger)
	if err != nil || !withSub {
		return pub, nil, err
	}
	inFlight := 1
	if spec.OneSubscription {
		inFlight = spec.BatchSize
	}
	client := redis.NewClient(opts)
	sub, err := redissub.NewSubscriber(redissub.Config{
		Client:        client,
		Consumer:      spec.Name,
		ConsumerGroup: spec.Topic,
		InFlight:      inFlight,
		ClaimInterval: redisClaimInterval(spec.ClaimTimeout),
		MaxIdleTime:   redisMaxIdle(spec.ClaimTimeout),
		OldestID:      "0",
	}, logger)
	if err != nil {
		_ = client.Close()
		_ = pub.Close()
		return nil, nil, err
	}
	return pub, closingClient{sub, client}, nil
}

// closingClient is a redissub.Subscriber that closes its client after it.
type closingClient struct {
	*redissub.Subscriber
	client *redis.Client
}

func (c closingClient) Close() error { return errors.Join(c.Subscriber.Close(), c.client.Close()) }

// brokerAdmin is the driver's side of the campaign's broker.
type brokerAdmin interface {
	// declare creates the topic, its consumer group or consumer, and the
	// dead-letter and poison destinations.
	declare(ctx context.Context) error
	// depth returns the deliveries of the topic not yet acked (RabbitMQ:
	// ready; JetStream: not yet delivered or awaiting their ack; Redis: not
	// yet read by the group or pending) and the messages on the dead-letter
	// and poison destinations.
	depth(ctx context.Context) (backlog, deadLettered int, err error)
	// publish puts a second delivery of msg on the topic (FaultSIGSTOP).
	publish(ctx context.Context, msg *message.Message) error
	// remove deletes what declare created.
	remove(ctx context.Context) error
}

func newBrokerAdmin(cfg Config, topic string) brokerAdmin {
	dests := []string{topic, topic + ".dead_letter", topic + ".poison"}
	switch cfg.Broker {
	case BrokerNATS:
		return &natsAdmin{url: cfg.NATS, topics: dests}
	case BrokerRedis:
		return &redisAdmin{url: cfg.Redis, topics: dests}
	default:
		return &amqpAdmin{url: cfg.AMQP, queues: dests}
	}
}

type amqpAdmin struct {
	url    string
	queues []string // the topic, its dead-letter and poison queues
}

func (a *amqpAdmin) withChannel(fn func(*amqp091.Channel) error) error {
	conn, err := amqp091.Dial(a.url)
	if err != nil {
		return fmt.Errorf("reliability: rabbitmq: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("reliability: rabbitmq: %w", err)
	}
	defer ch.Close()
	return fn(ch)
}

func (a *amqpAdmin) declare(context.Context) error {
	return a.withChannel(func(ch *amqp091.Channel) error {
		for _, q := range a.queues {
			if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
				return fmt.Errorf("reliability: declare queue %s: %w", q, err)
			}
		}
		return nil
	})
}

func (a *amqpAdmin) depth(context.Context) (backlog, deadLettered int, err error) {
	err = a.withChannel(func(ch *amqp091.Channel) error {
		for i, q := range a.queues {
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			if err != nil {
				return err
			}
			if i == 0 {
				backlog = st.Messages
			} else {
				deadLettered += st.Messages
			}
		}
		return nil
	})
	return backlog, deadLettered, err
}

func (a *amqpAdmin) publish(ctx context.Context, msg *message.Message) error {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return err
	}
	pub, err := m.Marshal(msg)
	if err != nil {
		return err
	}
	return a.withChannel(func(ch *amqp091.Channel) error {
		return ch.PublishWithContext(ctx, "", a.queues[0], false, false, pub)
	})
}

func (a *amqpAdmin) remove(context.Context) error {
	return a.withChannel(func(ch *amqp091.Channel) error {
		for _, q := range a.queues {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				return err
			}
		}
		return nil
	})
}

type natsAdmin struct {
	url    string
	topics []string // the topic, its dead-letter and poison subjects
}

// stream is the name of the stream of subject: stream names may not hold
// a dot.
func (*natsAdmin) stream(subject string) string { return strings.ReplaceAll(subject, ".", "_") }

func (a *natsAdmin) with(fn func(nats.JetStreamContext) error) error {
	nc, err := nats.Connect(a.url, nats.Name("reliability-driver"), nats.NoReconnect())
	if err != nil {
		return fmt.Errorf("reliability: nats: %w", err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return fmt.Errorf("reliability: nats: %w", err)
	}
	return fn(js)
}

func (a *natsAdmin) declare(ctx context.Context) error {
	return a.with(func(js nats.JetStreamContext) error {
		for _, s := range a.topics {
			if _, err := js.AddStream(&nats.StreamConfig{Name: a.stream(s), Subjects: []string{s}, Storage: nats.FileStorage}, nats.Context(ctx)); err != nil {
				return fmt.Errorf("reliability: add stream %s: %w", a.stream(s), err)
			}
		}
		return nil
	})
}

func (a *natsAdmin) depth(ctx context.Context) (backlog, deadLettered int, err error) {
	err = a.with(func(js nats.JetStreamContext) error {
		ci, err := js.ConsumerInfo(a.stream(a.topics[0]), natsConsumer(a.topics[0]), nats.Context(ctx))
		switch {
		case errors.Is(err, nats.ErrConsumerNotFound):
			// No consumer has subscribed yet: every message is waiting.
			si, err := js.StreamInfo(a.stream(a.topics[0]), nats.Context(ctx))
			if err != nil {
				return err
			}
			backlog = int(si.State.Msgs)
		case err != nil:
			return err
		default:
			backlog = int(ci.NumPending) + ci.NumAckPending
		}
		for _, s := range a.topics[1:] {
			si, err := js.StreamInfo(a.stream(s), nats.Context(ctx))
			if err != nil {
				return err
			}
			deadLettered += int(si.State.Msgs)
		}
		return nil
	})
	return backlog, deadLettered, err
}

func (a *natsAdmin) publish(ctx context.Context, msg *message.Message) error {
	nm, err := (&wnats.NATSMarshaler{}).Marshal(a.topics[0], msg)
	if err != nil {
		return err
	}
	return a.with(func(js nats.JetStreamContext) error {
		_, err := js.PublishMsg(nm, nats.Context(ctx))
		return err
	})
}

func (a *natsAdmin) remove(ctx context.Context) error {
	return a.with(func(js nats.JetStreamContext) error {
		var errs []error
		for _, s := range a.topics {
			if err := js.DeleteStream(a.stream(s), nats.Context(ctx)); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}

type redisAdmin struct {
	url    string
	topics []string // the topic, its dead-letter and poison streams
}

func (a *redisAdmin) with(fn func(*redis.Client) error) error {
	opts, err := redis.ParseURL(a.url)
	if err != nil {
		return fmt.Errorf("reliability: redis URL: %w", err)
	}
	c := redis.NewClient(opts)
	defer c.Close()
	return fn(c)
}

// declare creates the consumer group (and the stream) from the start, so
// that what the relay adds before a consumer subscribes is the group's.
func (a *redisAdmin) declare(ctx context.Context) error {
	return a.with(func(c *redis.Client) error {
		return c.XGroupCreateMkStream(ctx, a.topics[0], a.topics[0], "0").Err()
	})
}

func (a *redisAdmin) depth(ctx context.Context) (backlog, deadLettered int, err error) {
	err = a.with(func(c *redis.Client) error {
		groups, err := c.XInfoGroups(ctx, a.topics[0]).Result()
		if err != nil {
			return err
		}
		found := false
		for _, g := range groups {
			if g.Name == a.topics[0] {
				if g.Lag < 0 {
					return fmt.Errorf("reliability: redis cannot tell the lag of group %s", g.Name)
				}
				backlog, found = int(g.Lag+g.Pending), true
			}
		}
		if !found {
			return fmt.Errorf("reliability: redis: no consumer group %s", a.topics[0])
		}
		for _, s := range a.topics[1:] {
			n, err := c.XLen(ctx, s).Result()
			if err != nil {
				return err
			}
			deadLettered += int(n)
		}
		return nil
	})
	return backlog, deadLettered, err
}

func (a *redisAdmin) publish(ctx context.Context, msg *message.Message) error {
	values, err := redisstream.DefaultMarshallerUnmarshaller{}.Marshal(a.topics[0], msg)
	if err != nil {
		return err
	}
	return a.with(func(c *redis.Client) error {
		return c.XAdd(ctx, &redis.XAddArgs{Stream: a.topics[0], Values: values}).Err()
	})
}

func (a *redisAdmin) remove(ctx context.Context) error {
	return a.with(func(c *redis.Client) error {
		return c.Del(ctx, a.topics...).Err()
	})
}
