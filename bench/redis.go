package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/redissub"
	"github.com/settle-go/settle/sqldb"
)

// Section redis: Redis Streams + PostgreSQL, 16 deliveries in flight, by
// the two ways of having them in flight: 16 subscriptions of
// watermill-redisstream's subscriber (each reads XREADGROUP COUNT 1 and
// hands the router one entry at a time), or one redissub subscription
// reading XREADGROUP COUNT 16.
const (
	redisRaw     = "raw-consume" // the subscriber alone, a no-op handler, no database
	redisPerMsg  = "per-message" // settle HandleTx, one-statement, one commit per message
	redisGrouped = "batched"     // settle HandleTx with Batch: one commit per batch

	redisStock = "watermill-redisstream"
	redisOne   = "redissub"
)

var (
	redisCells = []string{redisRaw, redisPerMsg, redisGrouped}
	redisKinds = []string{redisStock, redisOne}
)

// RedisResults: section redis.
type RedisResults struct {
	Messages int        `json:"messages"`
	Warm     int        `json:"warm_up"`
	InFlight int        `json:"in_flight"`
	Rows     []RedisRow `json:"rows"`
}

// RedisRow is one subscriber: the median msgs/s of each cell, and every
// round's, in order (the cells of a round ran one after the other).
type RedisRow struct {
	Subscriber string               `json:"subscriber"`
	Rate       map[string]float64   `json:"msgs_per_s"`
	Rates      map[string][]float64 `json:"msgs_per_s_runs"`
	Checked    int                  `json:"effects_checked"`
}

type redisBench struct {
	o   options
	log io.Writer
	url string
}

func runRedis(ctx context.Context, o options, log io.Writer) (*RedisResults, error) {
	res := &RedisResults{Messages: 20_000, InFlight: batchInFlight}
	if o.quick {
		res.Messages = 4_000
	}
	res.Warm = res.Messages / 5
	b := &redisBench{o: o, log: log, url: env("SETTLE_REDIS_URL", "redis://127.0.0.1:6379/0")}
	db, dialect, err := sqlurl.Open(o.pgURL)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(2*batchInFlight + 8)
	db.SetMaxIdleConns(2*batchInFlight + 8)
	d := &batchDB{name: "postgres", db: db, dialect: dialect}
	defer d.close()
	rows := map[string]*RedisRow{}
	for _, kind := range redisKinds {
		rows[kind] = &RedisRow{Subscriber: kind, Rate: map[string]float64{}, Rates: map[string][]float64{}}
	}
	// Round by round, each cell with both subscribers one after the other,
	// so that the ratios are read within a round on a shared machine.
	for r := range o.runs {
		for _, cell := range redisCells {
			for _, kind := range redisKinds {
				rate, err := b.cell(ctx, d, kind, cell, res)
				if err != nil {
					return nil, fmt.Errorf("%s %s: %w", kind, cell, err)
				}
				if cell != redisRaw {
					rows[kind].Checked += res.Messages
				}
				fmt.Fprintf(log, "run %d %s %s: %.0f msgs/s\n", r+1, kind, cell, rate)
				rows[kind].Rates[cell] = append(rows[kind].Rates[cell], rate)
			}
		}
	}
	for _, kind := range redisKinds {
		row := rows[kind]
		for _, c := range redisCells {
			row.Rate[c] = median(slices.Clone(row.Rates[c]))
		}
		res.Rows = append(res.Rows, *row)
	}
	return res, nil
}

func (b *redisBench) client() (*redis.Client, error) {
	opts, err := redis.ParseURL(b.url)
	if err != nil {
		return nil, err
	}
	opts.PoolSize = 4 * batchInFlight
	return redis.NewClient(opts), nil
}

// prefill adds n messages to a new stream, as watermill-redisstream's
// publisher writes them, in pipelines of 500 XADDs.
func (b *redisBench) prefill(ctx context.Context, c *redis.Client, stream string, n int) error {
	m := redisstream.DefaultMarshallerUnmarshaller{}
	for i := 0; i < n; i += 500 {
		p := c.Pipeline()
		for j := i; j < min(n, i+500); j++ {
			values, err := m.Marshal(stream, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
			if err != nil {
				return err
			}
			p.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: values})
		}
		if _, err := p.Exec(ctx); err != nil {
			return err
		}
	}
	return nil
}

// cell consumes res.Messages prefilled messages and returns the rate after
// the warm-up.
func (b *redisBench) cell(ctx context.Context, d *batchDB, kind, cell string, res *RedisResults) (float64, error) {
	admin, err := b.client()
	if err != nil {
		return 0, err
	}
	defer admin.Close()
	stream, group := "bench_redis_"+randomID(), "bench"
	defer admin.Del(context.WithoutCancel(ctx), stream)
	if err := b.prefill(ctx, admin, stream, res.Messages); err != nil {
		return 0, err
	}
	sc, err := b.client()
	if err != nil {
		return 0, err
	}
	defer sc.Close() // watermill-redisstream's Close closes it too
	var sub message.Subscriber
	concurrency := batchInFlight
	if kind == redisOne {
		sub, err = redissub.NewSubscriber(redissub.Config{Client: sc, ConsumerGroup: group, InFlight: batchInFlight}, watermill.NopLogger{})
		concurrency = 1
	} else {
		sub, err = redisstream.NewSubscriber(redissub.SubscriberConfig(sc, group), watermill.NopLogger{})
	}
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	var count, first, id atomic.Int64
	if cell == redisRaw {
		for i := range concurrency {
			router.AddConsumerHandler(fmt.Sprintf("raw-%d", i), stream, sub, func(*message.Message) error {
				markFirst(&first)
				count.Add(1)
				return nil
			})
		}
		r, _, err := consumeSteady(ctx, router, &count, &first, res.Messages, res.Warm, "")
		return r, err
	}
	pc, err := b.client()
	if err != nil {
		return 0, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: pc}, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer pub.Close()
	store, err := d.store(ctx)
	if err != nil {
		return 0, err
	}
	effects, err := d.effectTable(ctx)
	if err != nil {
		return 0, err
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, Concurrency: concurrency, DisableTracing: true})
	if err != nil {
		return 0, err
	}
	insert := "INSERT INTO " + effects + " (id, msg) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"
	fn := func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		markFirst(&first)
		_, err := tx.ExecContext(ctx, insert, id.Add(1), msg.UUID)
		return err
	}
	txc := pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), OneStatement: true}
	if cell == redisGrouped {
		txc = pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), Batch: pipeline.BatchConfig{MaxSize: batchInFlight}}
	}
	hs, err := pipeline.HandleTx(p, "tx", stream, sub, txc, fn)
	if err != nil {
		return 0, err
	}
	hs.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				count.Add(1)
			}
			return out, err
		}
	})
	r, _, err := consumeSteady(ctx, router, &count, &first, res.Messages, res.Warm, "")
	if err != nil {
		return 0, err
	}
	return r, d.checkEffects(ctx, effects, res.Messages)
}

func redisTable(t *RedisResults) string {
	if t == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Redis Streams + PostgreSQL, %d deliveries in flight, %d messages per cell (the first %d not timed), msgs/s (median):\n\n", t.InFlight, t.Messages, t.Warm)
	b.WriteString("| subscriber | raw consume | settle per message | ratio to raw | settle batched | ratio to raw | effects checked |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range t.Rows {
		raw := r.Rate[redisRaw]
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", r.Subscriber, num(raw),
			num(r.Rate[redisPerMsg]), x(ratio(r.Rate[redisPerMsg], raw)),
			num(r.Rate[redisGrouped]), x(ratio(r.Rate[redisGrouped], raw)), num(float64(r.Checked)))
	}
	if len(t.Rows) == 2 {
		a, o := t.Rows[0].Rate, t.Rows[1].Rate
		fmt.Fprintf(&b, "\n%s / %s, of the medians: raw %s, per message %s, batched %s\n", t.Rows[1].Subscriber, t.Rows[0].Subscriber,
			x(ratio(o[redisRaw], a[redisRaw])), x(ratio(o[redisPerMsg], a[redisPerMsg])), x(ratio(o[redisGrouped], a[redisGrouped])))
		// Within each round, where the two ran minutes apart at most.
		for _, c := range redisCells {
			var rs []string
			ar, or := t.Rows[0].Rates[c], t.Rows[1].Rates[c]
			for i := range min(len(ar), len(or)) {
				rs = append(rs, x(ratio(or[i], ar[i])))
			}
			fmt.Fprintf(&b, "- %s, round by round: %s\n", c, strings.Join(rs, ", "))
		}
	}
	return b.String()
}
