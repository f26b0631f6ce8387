package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// The brokers of section brokers, in the order they run and appear.
const (
	brokerRabbitMQ = "RabbitMQ"
	brokerNATS     = "NATS JetStream"
	brokerRedis    = "Redis Streams"
	brokerSQL      = "watermill-sql on PostgreSQL"
)

var brokerNames = []string{brokerRabbitMQ, brokerNATS, brokerRedis, brokerSQL}

// Cells of section brokers, each on a fresh topic pre-filled with the same
// number of messages, consumed by brokersInFlight competing subscriptions.
const (
	brkRaw     = "raw"         // consume and ack, a no-op handler, no database
	brkPerMsg  = "per-message" // settle's stack, HandleTx one-statement: one commit per message
	brkBatched = "batched"     // settle's stack, HandleBatchTx: one commit per batch (group commit)
)

var brokerCells = []string{brkRaw, brkPerMsg, brkBatched}

// brokersInFlight is the competing subscriptions of every cell
// (pipeline.Config.Concurrency for settle's): the deliveries a batch can
// gather, where the subscriber hands them out at once.
const brokersInFlight = 16

// BrokersResults: section brokers.
type BrokersResults struct {
	Messages int          `json:"messages"`     // per settle cell
	RawN     int          `json:"raw_messages"` // per raw cell
	Warm     int          `json:"warm_up"`      // a tenth of the cell's messages
	InFlight int          `json:"in_flight"`
	Rows     []BrokersRow `json:"rows"`
}

// BrokersRow is one broker: the median rate of each cell over the rounds,
// every round's rate, the processor time per 1,000 messages of the round
// nearest the median, and the mean batch the batched cell committed.
type BrokersRow struct {
	Broker    string               `json:"broker"`
	Rate      map[string]float64   `json:"msgs_per_s"`
	Rates     map[string][]float64 `json:"msgs_per_s_runs"`
	CPU       map[string]CPUPerK   `json:"cpu_per_1000"`
	BatchMean float64              `json:"batch_mean"`
	Checked   int                  `json:"effects_checked"`
}

// brokerEnv are the servers of the section.
type brokerEnv struct {
	amqpURL, natsURL, redisURL string
}

func runBrokers(ctx context.Context, o options, log io.Writer) (*BrokersResults, error) {
	res := &BrokersResults{Messages: 6_000, InFlight: brokersInFlight}
	if o.quick {
		res.Messages = 1_500
	}
	// The raw cells are several times faster: more messages give their
	// timed window the same order of length.
	res.RawN = 4 * res.Messages
	res.Warm = res.Messages / 10 // and RawN/10 for the raw cells
	servers := brokerEnv{amqpURL: o.amqpURL, natsURL: env("SETTLE_NATS_URL", "nats://127.0.0.1:4222"), redisURL: env("SETTLE_REDIS_URL", "redis://127.0.0.1:6379/0")}
	p, err := openPG(ctx, o.pgURL, 40)
	if err != nil {
		return nil, err
	}
	b := &amqpBench{o: o, log: log, p: p}
	defer b.close()
	rows := map[string]*BrokersRow{}
	wins := map[string]map[string][]steadyWindow{}
	for _, name := range brokerNames {
		rows[name] = &BrokersRow{Broker: name, Rate: map[string]float64{}, Rates: map[string][]float64{}, CPU: map[string]CPUPerK{}}
		wins[name] = map[string][]steadyWindow{}
	}
	batches := map[string][]float64{}
	// Interleaved: every round runs every broker's cells one after the
	// other, so that a slow spell of the machine falls on all of them.
	for r := range o.runs {
		for _, name := range brokerNames {
			for _, cell := range brokerCells {
				n := res.Messages
				if cell == brkRaw {
					n = res.RawN
				}
				rate, win, mean, err := b.brokerCell(ctx, servers, name, cell, n, n/10)
				if err != nil {
					return nil, fmt.Errorf("%s %s: %w", name, cell, err)
				}
				row := rows[name]
				row.Rates[cell] = append(row.Rates[cell], rate)
				wins[name][cell] = append(wins[name][cell], win)
				if cell != brkRaw {
					row.Checked += res.Messages
				}
				if cell == brkBatched {
					batches[name] = append(batches[name], mean)
				}
				fmt.Fprintf(log, "run %d %s %s: %.0f msgs/s, %.1f ms process CPU per 1,000\n", r+1, name, cell, rate, win.CPU.perK(win.Messages).Go)
			}
		}
	}
	for _, name := range brokerNames {
		row := rows[name]
		for _, cell := range brokerCells {
			row.Rate[cell] = median(append([]float64(nil), row.Rates[cell]...))
			// The processor time of the round whose rate is nearest the
			// median.
			best := 0
			for i, v := range row.Rates[cell] {
				if abs(v-row.Rate[cell]) < abs(row.Rates[cell][best]-row.Rate[cell]) {
					best = i
				}
			}
			w := wins[name][cell][best]
			row.CPU[cell] = w.CPU.perK(w.Messages)
		}
		row.BatchMean = median(batches[name])
		res.Rows = append(res.Rows, *row)
	}
	return res, nil
}

func abs(f float64) float64 {
	if f < 0 {
		return -f
	}
	return f
}

// brokerPubSub is a broker's publisher and subscriber for one topic of the
// section, and what removes the topic afterwards.
type brokerPubSub struct {
	pub    message.Publisher
	sub    message.Subscriber
	remove func()
}

// newBrokerPubSub builds the publisher and subscriber of broker name, with
// the settings docs/brokers.md gives (one function per broker: the
// configuration to copy is in one place). group names the consumer group
// (or durable consumer) of the topic.
func (b *amqpBench) newBrokerPubSub(ctx context.Context, env brokerEnv, name, topic, group string) (*brokerPubSub, error) {
	logger := watermill.NopLogger{}
	switch name {
	case brokerRabbitMQ:
		return b.rabbitPubSub(topic)
	case brokerNATS:
		return natsPubSub(env.natsURL, topic, group, logger)
	case brokerRedis:
		return redisPubSub(ctx, env.redisURL, group, logger)
	case brokerSQL:
		return sqlPubSub(b.p.db, topic, group, logger)
	}
	return nil, fmt.Errorf("unknown broker %q", name)
}

// rabbitPubSub: durable queue, settle's marshaler, watermill-amqp's
// subscriber (one delivery at a time per subscription) with the batch
// section's prefetch, a confirming publisher.
func (b *amqpBench) rabbitPubSub(topic string) (*brokerPubSub, error) {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return nil, err
	}
	cfg := b.config(m)
	cfg.Consume.Qos.PrefetchCount = max(b.o.prefetch, batchPrefetch)
	cfg.Publish.ConfirmDelivery = true
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	b.queues = append(b.queues, topic)
	if err := sub.SubscribeInitialize(topic); err != nil {
		_ = sub.Close()
		return nil, err
	}
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	return &brokerPubSub{pub: pub, sub: sub, remove: func() {}}, nil
}

// natsPubSub: JetStream (watermill-nats v2), a stream per topic, a durable
// consumer shared by a queue group, manual and explicit acks.
func natsPubSub(url, topic, group string, logger watermill.LoggerAdapter) (*brokerPubSub, error) {
	js := wnats.JetStreamConfig{
		SubscribeOptions: []nats.SubOpt{
			nats.ManualAck(), nats.AckExplicit(), nats.AckWait(30 * time.Second), nats.DeliverAll(),
			nats.MaxAckPending(4 * brokersInFlight),
		},
		DurablePrefix:     group,
		DurableCalculator: func(prefix, topic string) string { return prefix + "_" + topic },
	}
	pub, err := wnats.NewPublisher(wnats.PublisherConfig{URL: url, JetStream: js}, logger)
	if err != nil {
		return nil, err
	}
	sub, err := wnats.NewSubscriber(wnats.SubscriberConfig{
		URL: url, QueueGroupPrefix: group, SubscribersCount: 1,
		AckWaitTimeout: 30 * time.Second, CloseTimeout: 10 * time.Second, JetStream: js,
	}, logger)
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		_ = pub.Close()
		_ = sub.Close()
		return nil, err
	}
	return &brokerPubSub{pub: pub, sub: sub, remove: func() {
		if nc, err := nats.Connect(url); err == nil {
			if js, err := nc.JetStream(); err == nil {
				_ = js.DeleteStream(topic)
			}
			nc.Close()
		}
	}}, nil
}

// redisPubSub: Redis Streams (watermill-redisstream), a consumer group,
// one consumer name for the process, short claim timings.
func redisPubSub(ctx context.Context, url, group string, logger watermill.LoggerAdapter) (*brokerPubSub, error) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opts.PoolSize = 4 * brokersInFlight
	client := redis.NewClient(opts)
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		return nil, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client}, logger)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: client, ConsumerGroup: group, Consumer: "bench-" + strconv.Itoa(os.Getpid()),
		OldestId: "0", MaxIdleTime: 5 * time.Second, ClaimInterval: time.Second,
		DisableIndefiniteInitialBlock: true,
	}, logger)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	return &brokerPubSub{pub: pub, sub: sub, remove: func() {
		_ = client.Del(context.Background(), group).Err()
		_ = client.Close()
	}}, nil
}

// sqlPubSub: watermill-sql v4 on PostgreSQL, a binary payload column, a
// consumer group, short poll and resend intervals.
func sqlPubSub(db *sql.DB, topic, group string, logger watermill.LoggerAdapter) (*brokerPubSub, error) {
	schema := wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
	offsets := wsql.DefaultPostgreSQLOffsetsAdapter{}
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
	if err != nil {
		return nil, err
	}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		ConsumerGroup: group, SchemaAdapter: schema, OffsetsAdapter: offsets,
		PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
	}, logger)
	if err != nil {
		return nil, err
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		_ = sub.Close()
		return nil, err
	}
	return &brokerPubSub{pub: pub, sub: sub, remove: func() {
		for _, t := range []string{"watermill_" + topic, "watermill_offsets_" + topic} {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+t)
		}
	}}, nil
}

// brokerCell pre-fills a fresh topic of broker name with n messages and
// consumes them in cell's way; it returns the rate after warm messages,
// the processor time of that window and, for the batched cell, the mean
// batch committed.
func (b *amqpBench) brokerCell(ctx context.Context, env brokerEnv, name, cell string, n, warm int) (float64, steadyWindow, float64, error) {
	id := randomID()
	topic, group := "bench_brk_"+id, "bench_"+id
	if name == brokerRedis {
		group = topic // the stream's key: removed with it
	}
	ps, err := b.newBrokerPubSub(ctx, env, name, topic, group)
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	defer ps.remove()
	defer func() { _ = ps.sub.Close(); _ = ps.pub.Close() }()
	if err := prefillTopic(ps.pub, topic, n); err != nil {
		return 0, steadyWindow{}, 0, fmt.Errorf("pre-fill: %w", err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	var count, first, batches, batched atomic.Int64
	if cell == brkRaw {
		for i := range brokersInFlight {
			router.AddConsumerHandler("raw#"+strconv.Itoa(i+1), topic, ps.sub, func(*message.Message) error {
				markFirst(&first)
				count.Add(1)
				return nil
			})
		}
		rate, win, err := consumeSteady(ctx, router, &count, &first, n, warm, "")
		return rate, win, 0, err
	}
	store, _, err := b.p.dedupeTable(ctx)
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	effects, err := b.p.effectTable(ctx)
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) }()
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps.pub, Store: store, Concurrency: brokersInFlight,
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(mp)},
	})
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	insert := "INSERT INTO " + effects + " (msg) VALUES ($1)"
	db := sqldb.Std(b.p.db, sqldb.Postgres)
	var hs pipeline.Handlers
	switch cell {
	case brkPerMsg:
		hs, err = pipeline.HandleTx(p, "tx", topic, ps.sub, pipeline.TxConfig[*sql.Tx]{DB: db, OneStatement: true},
			func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
				markFirst(&first)
				_, err := tx.ExecContext(ctx, insert, msg.UUID)
				return err
			})
	case brkBatched:
		// The same statement per message as per-message; one commit for
		// the batch.
		hs, err = pipeline.HandleBatchTx(p, "tx", topic, ps.sub, pipeline.TxConfig[*sql.Tx]{DB: db, Batch: pipeline.BatchConfig{MaxSize: brokersInFlight}},
			func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
				markFirst(&first)
				for _, msg := range msgs {
					if _, err := tx.ExecContext(ctx, insert, msg.UUID); err != nil {
						return err
					}
				}
				batches.Add(1)
				batched.Add(int64(len(msgs)))
				return nil
			})
	default:
		err = fmt.Errorf("unknown cell %q", cell)
	}
	if err != nil {
		return 0, steadyWindow{}, 0, err
	}
	// Innermost: the handler has returned, so its transaction committed.
	hs.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				count.Add(1)
			}
			return out, err
		}
	})
	rate, win, err := consumeSteady(ctx, router, &count, &first, n, warm, "")
	if err != nil {
		return 0, win, 0, err
	}
	mean := 0.0
	if k := batches.Load(); k > 0 {
		// Batches may be retried whole after a failure; the mean is of
		// those that committed.
		mean = float64(batched.Load()) / float64(k)
	}
	return rate, win, mean, b.p.checkEffects(ctx, effects, n)
}

// prefillTopic publishes n small messages to topic, 200 to a Publish call
// (watermill-sql writes them in one INSERT; the others one by one).
func prefillTopic(pub message.Publisher, topic string, n int) error {
	for i := 0; i < n; {
		k := min(200, n-i)
		msgs := make([]*message.Message, k)
		for j := range msgs {
			msgs[j] = message.NewMessage(watermill.NewUUID(), []byte(`{"n":`+strconv.Itoa(i+j)+`}`))
		}
		if err := pub.Publish(topic, msgs...); err != nil {
			return err
		}
		i += k
	}
	return nil
}

// brokersTable renders section brokers: a row per broker and cell, the
// rate beside the processor time per message.
func brokersTable(t *BrokersResults) string {
	if t == nil {
		return "(not measured)"
	}
	var s strings.Builder
	s.WriteString("| broker | cell | msgs/s | ÷ raw | ÷ per message | mean batch | CPU ms per 1,000 msgs: this process | broker server | PostgreSQL | whole machine |\n")
	s.WriteString("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, r := range t.Rows {
		for _, cell := range brokerCells {
			vsRaw, vsPer, batch := "", "", ""
			if cell != brkRaw {
				vsRaw = x(ratio(r.Rate[cell], r.Rate[brkRaw]))
			}
			if cell == brkBatched {
				vsPer = x(ratio(r.Rate[cell], r.Rate[brkPerMsg]))
				batch = strconv.FormatFloat(r.BatchMean, 'f', 1, 64)
			}
			c := r.CPU[cell]
			fmt.Fprintf(&s, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.Broker, cell, num(r.Rate[cell]), vsRaw, vsPer, batch, num(c.Go), num(c.Broker), num(c.DB), num(c.Busy))
		}
	}
	return strings.TrimRight(s.String(), "\n")
}
