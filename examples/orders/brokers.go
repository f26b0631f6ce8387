package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/redissub"
	"github.com/settle-go/settle/sqldb"
)

// The brokers the example runs on (-broker).
const (
	brokerGoChannel = "gochannel"
	brokerAMQP      = "amqp"
	brokerNATS      = "nats"
	brokerRedis     = "redis"
	brokerSQL       = "sql"
)

// brokerSpec is which broker a run uses, and where it is.
type brokerSpec struct {
	// Kind is one of the broker constants; "" is RabbitMQ when AMQP is
	// set, else GoChannel.
	Kind              string
	AMQP, NATS, Redis string
}

// resolve fills in Kind and checks that the broker it names has a URL.
func (b brokerSpec) resolve() (brokerSpec, error) {
	if b.Kind == "" {
		b.Kind = brokerGoChannel
		if b.AMQP != "" {
			b.Kind = brokerAMQP
		}
	}
	need := func(url, flag, env string) error {
		if url == "" {
			return fmt.Errorf("-broker %s needs -%s or $%s", b.Kind, flag, env)
		}
		return nil
	}
	switch b.Kind {
	case brokerGoChannel, brokerSQL:
		return b, nil
	case brokerAMQP:
		return b, need(b.AMQP, "amqp", "SETTLE_AMQP_URL")
	case brokerNATS:
		return b, need(b.NATS, "nats", "SETTLE_NATS_URL")
	case brokerRedis:
		return b, need(b.Redis, "redis", "SETTLE_REDIS_URL")
	}
	return b, fmt.Errorf("-broker %q: want gochannel, amqp, nats, redis or sql", b.Kind)
}

type topicNames struct {
	placed, charged string
	all             []string
}

// newTopicNames are a run's topics. Their names are valid as RabbitMQ
// queues, JetStream stream and consumer names (no dots) and watermill-sql
// table suffixes alike.
func newTopicNames(runID string) topicNames {
	t := topicNames{placed: "orders_placed_" + runID, charged: "orders_charged_" + runID}
	// No parking topics: the dead-lettered and poisoned messages are parked
	// in a table (schema.parked).
	t.all = []string{t.placed, t.charged}
	return t
}

// broker is the run's broker behind Watermill's interfaces.
type broker struct {
	kind   string
	system string // messaging.system on the spans, and the name the run prints
	pub    message.Publisher
	sub    message.Subscriber
	topics topicNames
	close  func()
	// remove deletes what the run made on the broker (queues, streams,
	// tables); nil for GoChannel. what names it for a kept run.
	remove func()
	what   string
}

// removeRun deletes what a run made on the broker: its queues (RabbitMQ),
// streams and consumers (NATS, Redis). watermill-sql's tables are found and
// dropped with the run's other tables.
func removeRun(ctx context.Context, spec brokerSpec, runID string) {
	t := newTopicNames(runID)
	switch spec.Kind {
	case brokerAMQP:
		deleteQueues(spec.AMQP, t.all)
	case brokerNATS:
		deleteStreams(spec.NATS, t.all)
	case brokerRedis:
		deleteRedisStreams(ctx, spec.Redis, t.all)
	}
}

// brokerObjects is what the kind of broker calls what removeRun deletes.
func brokerObjects(kind string) string {
	switch kind {
	case brokerNATS, brokerRedis:
		return "streams"
	}
	return "queues"
}

// newBroker connects to the broker of spec. db, d and pool are the run's
// database, for the SQL broker.
func newBroker(ctx context.Context, spec brokerSpec, runID string, db *sql.DB, d sqldb.Dialect, pool *pgxpool.Pool) (*broker, error) {
	t := newTopicNames(runID)
	var (
		b   *broker
		err error
	)
	switch spec.Kind {
	case brokerGoChannel:
		ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})
		b = &broker{system: "gochannel", pub: ps, sub: ps, close: func() { _ = ps.Close() }}
	case brokerAMQP:
		b, err = newRabbitMQ(spec.AMQP, t)
	case brokerNATS:
		b, err = newNATS(spec.NATS, runID, t)
	case brokerRedis:
		b, err = newRedis(ctx, spec.Redis, runID, t)
	case brokerSQL:
		b, err = newSQLBroker(db, d, pool, t)
	default:
		err = fmt.Errorf("unknown broker %q", spec.Kind)
	}
	if err != nil {
		return nil, err
	}
	b.kind, b.topics = spec.Kind, t
	switch spec.Kind {
	case brokerGoChannel:
	case brokerSQL:
		tables := brokerTableNames(runID)
		b.remove = func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for _, table := range tables {
				_, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table)
			}
		}
		b.what = "tables " + strings.Join(tables, ", ")
	default:
		b.remove = func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			removeRun(ctx, spec, runID)
		}
		b.what = brokerObjects(spec.Kind) + " " + strings.Join(t.all, ", ")
	}
	return b, nil
}

// newRabbitMQ is the publisher and subscriber on RabbitMQ: durable queues,
// settle's marshaler (keeps deliveries with odd headers), and settle's
// publisher, which waits for the broker's confirmation of every message and
// fails one the broker routed to no queue (docs/poison.md).
func newRabbitMQ(url string, t topicNames) (*broker, error) {
	logger := watermill.NopLogger{}
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return nil, err
	}
	cfg := amqp.NewDurableQueueConfig(url)
	cfg.Marshaler = m
	cfg.Consume.Qos.PrefetchCount = 16
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, logger)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	// Declare the queues now, so that the first messages published to them
	// are kept.
	for _, q := range t.all {
		if err := sub.SubscribeInitialize(q); err != nil {
			_ = pub.Close()
			_ = sub.Close()
			return nil, fmt.Errorf("rabbitmq: declare %s: %w", q, err)
		}
	}
	return &broker{system: "rabbitmq", pub: pub, sub: sub, close: func() {
		_ = pub.Close()
		_ = sub.Close()
	}}, nil
}

// natsAckWait is how long JetStream waits for a delivery's ack before it
// delivers the message again. settle renews its claim while a handler
// runs, so a redelivery that comes while the first is still running is
// deferred, not run twice; the wait only bounds how long a dead consumer's
// message stays away.
const natsAckWait = 30 * time.Second

// newNATS is the publisher and subscriber on NATS JetStream, as settle's
// natsjs sets them up: the publisher waits for the stream's ack and does
// not set TrackMsgId (JetStream would drop a message whose UUID it saw
// within its duplicate window: a deduplication that settle's store does
// durably, and that would hide the example's redelivered orders); the
// subscriber reads through a durable consumer per topic (the run's group
// and the topic) that it creates and that outlives it, with manual acks, a
// wait for the router without end, the delivery's JetStream count and the
// broker's nack delay. natsjs creates no stream: they are made here, like
// RabbitMQ's queues, one per topic.
func newNATS(url, runID string, t topicNames) (*broker, error) {
	logger := watermill.NopLogger{}
	group := "orders_" + runID
	opts := []nats.Option{nats.Name("settle-orders")}
	if err := addStreams(url, t.all); err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	pc := natsjs.NewPublisherConfig(url)
	pc.NatsOptions = append(pc.NatsOptions, opts...)
	pub, err := natsjs.NewPublisher(pc, logger)
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	sub, err := natsjs.NewSubscriber(url, natsjs.Config{Durable: group, AckWait: natsAckWait, NatsOptions: opts}, logger)
	if err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	return &broker{system: "nats", pub: pub, sub: sub, close: func() {
		_ = sub.Close()
		_ = pub.Close()
	}}, nil
}

// addStreams makes a file-stored JetStream stream for each topic, named as
// the topic and taking its subject.
func addStreams(url string, topics []string) error {
	nc, err := nats.Connect(url, nats.Name("settle-orders"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return err
	}
	for _, topic := range topics {
		_, err := js.AddStream(&nats.StreamConfig{Name: topic, Subjects: []string{topic}, Storage: nats.FileStorage})
		if err != nil && !errors.Is(err, nats.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("stream %s: %w", topic, err)
		}
	}
	return nil
}

// deleteStreams removes JetStream streams (and their consumers).
func deleteStreams(url string, streams []string) {
	nc, err := nats.Connect(url, nats.Name("settle-orders"))
	if err != nil {
		return
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return
	}
	for _, s := range streams {
		_ = js.DeleteStream(s)
	}
}

// Redis consumer-group timings. A pending message whose consumer died is
// delivered again only when a live consumer claims it: it must have been
// idle MaxIdleTime, and the claim loop looks every ClaimInterval. The
// defaults (60s, 5s) leave a dead consumer's messages away for a minute; a
// live handler's message is claimed away from it after MaxIdleTime too,
// which settle defers as a busy key.
const (
	redisMaxIdle       = 5 * time.Second
	redisClaimInterval = time.Second
)

// newRedis is the publisher and subscriber on Redis Streams:
// watermill-redisstream's publisher and settle's redissub subscriber (the
// pending entry's delivery count, no consumer deletion, a long handler's
// entry kept from being claimed away), a consumer group per run, one
// consumer name per process, and short claim timings.
func newRedis(ctx context.Context, url, runID string, t topicNames) (*broker, error) {
	logger := watermill.NopLogger{}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	client := redis.NewClient(opts)
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis: %w", err)
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, logger)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis: %w", err)
	}
	host, _ := os.Hostname()
	sub, err := redissub.NewSubscriber(redissub.Config{
		Client:        client, // not closed by the subscriber: by close below
		ConsumerGroup: "orders_" + runID,
		Consumer:      host + "-" + strconv.Itoa(os.Getpid()),
		// The group reads each stream from its first entry.
		OldestID:      "0",
		MaxIdleTime:   redisMaxIdle,
		ClaimInterval: redisClaimInterval,
	}, logger)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis: %w", err)
	}
	return &broker{system: "redis", pub: pub, sub: sub, close: func() {
		_ = sub.Close()
		_ = pub.Close()
		_ = client.Close()
	}}, nil
}

// deleteRedisStreams removes Redis streams (and their consumer groups).
func deleteRedisStreams(ctx context.Context, url string, streams []string) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return
	}
	client := redis.NewClient(opts)
	defer client.Close()
	_ = client.Del(ctx, streams...).Err()
}

// newSQLBroker is watermill-sql on the run's database: the messages of a
// topic in a table of their own, a consumer group's offset in another.
// The payload column is binary, not watermill-sql's default JSON: a JSON
// column refuses a payload that is not JSON at publish time, so the
// malformed message would never reach the consumer (docs/brokers.md).
//
// Only PostgreSQL is taken. On SQLite watermill-sql's subscriber (package
// sqlitepubsub) holds the database's only write lock while the handler
// runs, and the charge handler writes in its own transaction. On MySQL its
// offsets adapter can pass over a row committed out of order by concurrent
// writers, for good, and the example has them (the relay and the
// redelivered orders): run here, 1 run in about 10 lost a delivery that
// way (docs/brokers.md).
func newSQLBroker(db *sql.DB, d sqldb.Dialect, pool *pgxpool.Pool, t topicNames) (*broker, error) {
	logger := watermill.NopLogger{}
	var (
		schema  wsql.SchemaAdapter
		offsets wsql.OffsetsAdapter
		system  string
	)
	switch d {
	case sqldb.Postgres:
		schema = wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
		offsets = wsql.DefaultPostgreSQLOffsetsAdapter{}
		system = "postgresql"
	case sqldb.MySQL:
		return nil, errors.New("-broker sql needs a PostgreSQL database (-db): on MySQL watermill-sql's subscriber can skip a row committed out of order by concurrent publishers (docs/brokers.md)")
	default:
		return nil, errors.New("-broker sql needs a PostgreSQL database (-db): on SQLite watermill-sql's subscriber holds the file's write lock while the handler runs")
	}
	beginner := wsql.BeginnerFromStdSQL(db)
	if pool != nil {
		beginner = wsql.BeginnerFromPgx(pool)
	}
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: schema}, logger)
	if err != nil {
		return nil, fmt.Errorf("watermill-sql: %w", err)
	}
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup:  "orders",
		SchemaAdapter:  schema,
		OffsetsAdapter: offsets,
		PollInterval:   20 * time.Millisecond,
		// settle waits before it nacks (RedeliveryDelay, BusyDelay); the
		// subscriber need not wait again.
		ResendInterval: 10 * time.Millisecond,
	}, logger)
	if err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("watermill-sql: %w", err)
	}
	// Make the tables now (a real service does it in its migrations).
	for _, topic := range t.all {
		if err := sub.SubscribeInitialize(topic); err != nil {
			_ = pub.Close()
			_ = sub.Close()
			return nil, fmt.Errorf("watermill-sql: tables of %s: %w", topic, err)
		}
	}
	return &broker{system: "watermill-sql/" + system, pub: pub, sub: sub, close: func() {
		_ = sub.Close()
		_ = pub.Close()
	}}, nil
}

// sqlBrokerTable matches watermill-sql's tables of a run's topics.
var sqlBrokerTable = regexp.MustCompile(`^watermill_(?:offsets_)?orders_(?:placed|charged)_(` + runIDPattern + `)$`)

// brokerTableNames are the tables watermill-sql makes for a run.
func brokerTableNames(runID string) []string {
	var names []string
	for _, topic := range newTopicNames(runID).all {
		names = append(names, "watermill_"+topic, "watermill_offsets_"+topic)
	}
	return names
}

// deleteQueues removes RabbitMQ queues.
func deleteQueues(url string, queues []string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer func() { _ = ch.Close() }()
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			// An error closes the channel: go on with a new one.
			if ch, err = conn.Channel(); err != nil {
				return
			}
		}
	}
}
