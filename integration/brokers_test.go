package integration_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/brokertest"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/redissub"
	"github.com/settle-go/settle/sqldb"
)

// TestBrokers runs the broker conformance suite (package brokertest) on
// every broker settle supports here, NATS JetStream and Redis Streams both
// with watermill's subscriber set up by hand and with settle's (natsjs,
// redissub). GoChannel runs it in brokertest's own tests (no server
// needed). Each broker's publisher and subscribers are made by one function
// below (amqpPubSub, natsPubSub, natsjsPubSub, redisPubSub, sqlPubSub);
// the harness around them adds the backlog query and the clean-up of each
// case's topics.
func TestBrokers(t *testing.T) {
	brokers := []struct {
		name  string
		setup func(t *testing.T) brokertest.Harness
	}{
		{"amqp", func(t *testing.T) brokertest.Harness { return amqpHarness(t, false) }},
		{"amqpsub", func(t *testing.T) brokertest.Harness { return amqpHarness(t, true) }},
		{"nats", func(t *testing.T) brokertest.Harness { return natsHarness(t, false) }},
		{"natsjs", func(t *testing.T) brokertest.Harness { return natsHarness(t, true) }},
		{"redis", func(t *testing.T) brokertest.Harness { return redisHarness(t, false) }},
		{"redissub", func(t *testing.T) brokertest.Harness { return redisHarness(t, true) }},
		{"sql_postgres", func(t *testing.T) brokertest.Harness { return sqlHarness(t, testenv.Postgres(t)) }},
		{"sql_mariadb", func(t *testing.T) brokertest.Harness { return sqlHarness(t, testenv.MySQL(t)) }},
	}
	for _, b := range brokers {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			brokertest.Run(t, b.setup)
		})
	}
}

func closeOnCleanup(t *testing.T, what string, c interface{ Close() error }) {
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close %s: %v", what, err)
		}
	})
}

// --- RabbitMQ ---

// amqpPubSub is the RabbitMQ publisher and subscribers: durable queues, one
// per topic, settle's marshaler and publisher confirms. With useAMQPSub the
// publisher and subscribers are settle's amqpsub, else watermill-amqp's.
func amqpPubSub(t *testing.T, url string, useAMQPSub bool) (message.Publisher, func(t *testing.T) message.Subscriber) {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := amqp.NewDurableQueueConfig(url)
	cfg.Marshaler = m
	cfg.Publish.ConfirmDelivery = true
	cfg.Consume.Qos.PrefetchCount = 8
	var pub message.Publisher
	if useAMQPSub {
		pub, err = amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, nil)
	} else {
		pub, err = amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	}
	if err != nil {
		t.Fatal(err)
	}
	closeOnCleanup(t, "publisher", pub)
	return pub, func(t *testing.T) message.Subscriber {
		var sub message.Subscriber
		var err error
		if useAMQPSub {
			sub, err = amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg, InFlight: 4}, nil)
		} else {
			sub, err = amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
		}
		if err != nil {
			t.Fatal(err)
		}
		closeOnCleanup(t, "subscriber", sub)
		return sub
	}
}

func amqpHarness(t *testing.T, useAMQPSub bool) brokertest.Harness {
	url := testenv.AMQPURL(t)
	db := testenv.Postgres(t)
	pub, newSub := amqpPubSub(t, url, useAMQPSub)
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return brokertest.Harness{
		Publisher:     pub,
		NewSubscriber: newSub,
		DB:            db.DB,
		Dialect:       db.Dialect,
		// The queue's ready messages: with every consumer closed, RabbitMQ
		// has put back what they held unacked.
		Backlog: func(ctx context.Context, topic string) (int, error) {
			ch, err := conn.Channel()
			if err != nil {
				return 0, err
			}
			defer ch.Close()
			q, err := ch.QueueDeclarePassive(topic, true, false, false, false, nil)
			return q.Messages, err
		},
		DropTopic: func(ctx context.Context, topic string) error {
			ch, err := conn.Channel()
			if err != nil {
				return err
			}
			defer ch.Close()
			_, err = ch.QueueDelete(topic, false, false, false)
			return err
		},
	}
}

// --- NATS JetStream ---

// natsAckWait is how long JetStream waits for a delivery's ack before it
// redelivers it: how soon a dead consumer's message comes back.
const natsAckWait = 2 * time.Second

// natsPubSub is the NATS JetStream publisher and subscribers
// (watermill-nats v2): a stream per topic, created on first use; one
// durable push consumer per topic shared by every subscriber as one queue
// group, so that they compete; manual acks.
//
// The durable consumer is created here before watermill-nats subscribes:
// nats.go deletes a consumer it created itself when that subscription is
// unsubscribed (nats.go v1.37.0 js.go, "Since the library created the JS
// consumer, it will delete it on Unsubscribe()/Drain()"), which
// watermill-nats does on Close. The group's acks would go with it, and the
// next subscriber would create it again and get the whole stream again.
func natsPubSub(t *testing.T, url string) (message.Publisher, func(t *testing.T) message.Subscriber) {
	js := wmnats.JetStreamConfig{
		AutoProvision: true,
		SubscribeOptions: []nats.SubOpt{
			// Without ManualAck nats.go acks a message when the
			// subscriber's callback returns, which it does at
			// AckWaitTimeout or Close whether or not the router is done.
			nats.ManualAck(),
			nats.AckWait(natsAckWait),
			nats.DeliverAll(),
		},
		DurablePrefix:     "settle",
		DurableCalculator: natsGroup,
	}
	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: url, JetStream: js}, nil)
	if err != nil {
		t.Fatal(err)
	}
	closeOnCleanup(t, "publisher", pub)
	return pub, func(t *testing.T) message.Subscriber {
		nc, err := nats.Connect(url)
		if err != nil {
			t.Fatal(err)
		}
		sub, err := wmnats.NewSubscriberWithNatsConn(nc, wmnats.SubscriberSubscriptionConfig{
			QueueGroupPrefix: "settle",
			SubjectCalculator: func(prefix, topic string) *wmnats.SubjectDetail {
				return &wmnats.SubjectDetail{Primary: topic, QueueGroup: natsGroup(prefix, topic)}
			},
			AckWaitTimeout: natsAckWait,
			CloseTimeout:   10 * time.Second,
			JetStream:      js,
		}, nil)
		if err != nil {
			nc.Close()
			t.Fatal(err)
		}
		closeOnCleanup(t, "subscriber", sub)
		jsc, err := nc.JetStream()
		if err != nil {
			t.Fatal(err)
		}
		return natsDurable{Subscriber: sub, js: jsc}
	}
}

// natsDurable creates a topic's stream and durable consumer before it
// subscribes (see natsPubSub).
type natsDurable struct {
	*wmnats.Subscriber
	js nats.JetStreamContext
}

func (s natsDurable) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.SubscribeInitialize(topic); err != nil {
		return nil, err
	}
	group := natsGroup("settle", topic)
	if _, err := s.js.ConsumerInfo(topic, group); err == nil {
		return s.Subscriber.Subscribe(ctx, topic)
	}
	_, err := s.js.AddConsumer(topic, &nats.ConsumerConfig{
		Durable:        group,
		DeliverGroup:   group,
		DeliverSubject: nats.NewInbox(),
		DeliverPolicy:  nats.DeliverAllPolicy,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        natsAckWait,
		FilterSubject:  topic,
	})
	if err != nil {
		// Another subscriber of the group may have created it since.
		if _, infoErr := s.js.ConsumerInfo(topic, group); infoErr != nil {
			return nil, err
		}
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// natsjsPubSub is settle's NATS JetStream set-up: natsjs's publisher
// configuration and subscriber (the durable consumer "settle_<topic>",
// created by Subscribe, manual acks, the delivery count, the broker's nack
// delay). natsjs creates no stream: the publisher and subscribers here
// create each topic's stream (named as the topic) before they use it, as an
// application's deployment would.
func natsjsPubSub(t *testing.T, url string) (message.Publisher, func(t *testing.T) message.Subscriber) {
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	streams := natsStreams{js: js}
	p, err := wmnats.NewPublisher(natsjs.NewPublisherConfig(url), nil)
	if err != nil {
		t.Fatal(err)
	}
	closeOnCleanup(t, "publisher", p)
	return streamPublisher{p, streams.ensure}, func(t *testing.T) message.Subscriber {
		sub, err := natsjs.NewSubscriber(url, natsjs.Config{Durable: "settle", AckWait: natsAckWait}, nil)
		if err != nil {
			t.Fatal(err)
		}
		closeOnCleanup(t, "subscriber", sub)
		return streamSubscriber{sub, streams.ensure}
	}
}

// natsStreams creates the stream of a topic unless it exists.
type natsStreams struct{ js nats.JetStreamContext }

func (s natsStreams) ensure(topic string) error {
	if _, err := s.js.StreamInfo(topic); err == nil {
		return nil
	}
	_, err := s.js.AddStream(&nats.StreamConfig{Name: topic, Subjects: []string{topic}})
	if err != nil && !errors.Is(err, nats.ErrStreamNameAlreadyInUse) {
		return err
	}
	return nil
}

// streamPublisher and streamSubscriber create a topic's stream before they
// use it.
type streamPublisher struct {
	message.Publisher
	ensure func(topic string) error
}

func (p streamPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.ensure(topic); err != nil {
		return err
	}
	return p.Publisher.Publish(topic, msgs...)
}

type streamSubscriber struct {
	*natsjs.Subscriber
	ensure func(topic string) error
}

func (s streamSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.ensure(topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s streamSubscriber) SubscribeInitialize(topic string) error {
	if err := s.ensure(topic); err != nil {
		return err
	}
	return s.Subscriber.SubscribeInitialize(topic)
}

// natsGroup names a topic's durable consumer and queue group.
func natsGroup(prefix, topic string) string { return prefix + "_" + topic }

func natsHarness(t *testing.T, settles bool) brokertest.Harness {
	url := testenv.NATSURL(t)
	db := testenv.Postgres(t)
	pub, newSub := natsPubSub(t, url)
	consumer := func(topic string) string { return natsGroup("settle", topic) }
	if settles {
		pub, newSub = natsjsPubSub(t, url)
		consumer = func(topic string) string { return "settle_" + topic } // natsjs: Durable "_" topic
	}
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	return brokertest.Harness{
		Publisher:     pub,
		NewSubscriber: newSub,
		DB:            db.DB,
		Dialect:       db.Dialect,
		// Messages the group's consumer has not delivered yet, and those
		// delivered and not acked.
		Backlog: func(ctx context.Context, topic string) (int, error) {
			ci, err := js.ConsumerInfo(topic, consumer(topic), nats.Context(ctx))
			if err != nil {
				return 0, err
			}
			return int(ci.NumPending) + ci.NumAckPending, nil
		},
		DropTopic: func(ctx context.Context, topic string) error {
			err := js.DeleteStream(topic, nats.Context(ctx))
			if errors.Is(err, nats.ErrStreamNotFound) {
				return nil // a topic the case did not use
			}
			return err
		},
	}
}

// --- Redis Streams ---

// redisPubSub is the Redis Streams publisher (watermill-redisstream) and
// subscribers: one consumer group, each subscriber on a client of its own.
// Without settles they are watermill-redisstream's (a consumer name each,
// the library's default, a new UUID); with it settle's redissub (Redis's
// delivery count, no consumer deletion, entries kept from going idle while
// a handler runs). A dead consumer's pending entries are claimed by a live
// one after MaxIdleTime, checked every ClaimInterval; both are short here
// so that the kill case takes seconds, not the defaults' minute.
func redisPubSub(t *testing.T, url string, settles bool) (message.Publisher, func(t *testing.T) message.Subscriber) {
	const maxIdle, claimInterval = time.Second, 200 * time.Millisecond
	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	closeOnCleanup(t, "publisher", pub)
	return pub, func(t *testing.T) message.Subscriber {
		var (
			sub message.Subscriber
			err error
		)
		if settles {
			client := redis.NewClient(opts) // redissub does not close it
			closeOnCleanup(t, "redis client", client)
			sub, err = redissub.NewSubscriber(redissub.Config{
				Client: client, ConsumerGroup: "settle", MaxIdleTime: maxIdle, ClaimInterval: claimInterval,
			}, nil)
		} else {
			sub, err = redisstream.NewSubscriber(redisstream.SubscriberConfig{
				Client:        redis.NewClient(opts), // closed by the subscriber's Close
				ConsumerGroup: "settle",
				MaxIdleTime:   maxIdle,
				ClaimInterval: claimInterval,
				// Else the first XREADGROUP blocks without a timeout and its
				// goroutine outlives Close.
				DisableIndefiniteInitialBlock: true,
			}, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
		closeOnCleanup(t, "subscriber", sub)
		return sub
	}
}

func redisHarness(t *testing.T, settles bool) brokertest.Harness {
	url := testenv.RedisURL(t)
	db := testenv.Postgres(t)
	pub, newSub := redisPubSub(t, url, settles)
	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opts)
	t.Cleanup(func() { _ = rc.Close() })
	return brokertest.Harness{
		Publisher:     pub,
		NewSubscriber: newSub,
		DB:            db.DB,
		Dialect:       db.Dialect,
		// The group's pending entries (delivered, not acked) and its lag
		// (entries not delivered to the group yet).
		Backlog: func(ctx context.Context, topic string) (int, error) {
			groups, err := rc.XInfoGroups(ctx, topic).Result()
			if err != nil {
				return 0, err
			}
			for _, g := range groups {
				if g.Name == "settle" {
					return int(g.Pending + g.Lag), nil
				}
			}
			return 0, fmt.Errorf("no consumer group settle on %s", topic)
		},
		DropTopic: func(ctx context.Context, topic string) error { return rc.Del(ctx, topic).Err() },
	}
}

// --- watermill-sql ---

// sqlPubSub is the watermill-sql publisher and subscribers on db: a
// messages table and an offsets table per topic, one consumer group, each
// subscriber on a connection pool of its own. The payload column is
// binary: the default JSON column refuses a payload that is not JSON.
func sqlPubSub(t *testing.T, db testenv.DB, open func(testing.TB) testenv.DB) (message.Publisher, func(t *testing.T) message.Subscriber) {
	var schema wmsql.SchemaAdapter
	var offsets wmsql.OffsetsAdapter
	if db.Dialect == sqldb.Postgres {
		schema = wmsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
		offsets = wmsql.DefaultPostgreSQLOffsetsAdapter{}
	} else {
		schema = wmsql.DefaultMySQLSchema{GeneratePayloadType: func(string) string { return "BLOB" }}
		offsets = wmsql.DefaultMySQLOffsetsAdapter{}
	}
	pub, err := wmsql.NewPublisher(wmsql.BeginnerFromStdSQL(db.DB), wmsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	closeOnCleanup(t, "publisher", pub)
	ackDeadline := 10 * time.Second
	return pub, func(t *testing.T) message.Subscriber {
		own := open(t) // closed when t ends
		sub, err := wmsql.NewSubscriber(wmsql.BeginnerFromStdSQL(own.DB), wmsql.SubscriberConfig{
			ConsumerGroup:    "settle",
			SchemaAdapter:    schema,
			OffsetsAdapter:   offsets,
			InitializeSchema: true,
			PollInterval:     20 * time.Millisecond,
			ResendInterval:   20 * time.Millisecond,
			RetryInterval:    50 * time.Millisecond,
			AckDeadline:      &ackDeadline,
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		closeOnCleanup(t, "subscriber", sub)
		return sub
	}
}

func sqlHarness(t *testing.T, db testenv.DB) brokertest.Harness {
	open := testenv.Postgres
	quote := func(s string) string { return `"` + s + `"` }
	if db.Dialect == sqldb.MySQL {
		open = testenv.MySQL
		quote = func(s string) string { return "`" + s + "`" }
	}
	pub, newSub := sqlPubSub(t, db, open)
	ph := "?"
	if db.Dialect == sqldb.Postgres {
		ph = "$1"
	}
	return brokertest.Harness{
		Publisher:     pub,
		NewSubscriber: newSub,
		DB:            db.DB,
		Dialect:       db.Dialect,
		// The rows past the group's acked offset.
		Backlog: func(ctx context.Context, topic string) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+quote("watermill_"+topic)+
				" WHERE "+quote("offset")+" > COALESCE((SELECT offset_acked FROM "+quote("watermill_offsets_"+topic)+
				" WHERE consumer_group = "+ph+"), 0)", "settle").Scan(&n)
			return n, err
		},
		DropTopic: func(ctx context.Context, topic string) error {
			for _, table := range []string{"watermill_" + topic, "watermill_offsets_" + topic} {
				if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+quote(table)); err != nil {
					return err
				}
			}
			return nil
		},
	}
}
