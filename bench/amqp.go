package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

var amqpConcurrency = []int{1, 2, 4, 8, 16}

// AMQP cells.
const (
	amqpRaw     = "amqp-raw"       // raw watermill-amqp consume, no-op handler
	pgRaw       = "pg-raw-tx"      // BEGIN; INSERT; COMMIT alone, no broker
	settleOne   = "settle-one"     // settle's stack, HandleTx with OneStatement
	settleTwoSt = "settle-default" // settle's stack, HandleTx default (claim outside, confirm inside)
)

var amqpCells = []string{amqpRaw, pgRaw, settleOne, settleTwoSt}

// AMQPResults: section amqp.
type AMQPResults struct {
	Prefetch int       `json:"prefetch"`
	RawN     int       `json:"raw_messages"`
	TxN      int       `json:"tx_messages"`
	Rows     []AMQPRow `json:"rows"`
}

// AMQPRow is one concurrency: median msgs/s of each cell.
type AMQPRow struct {
	Concurrency int                `json:"concurrency"`
	Rate        map[string]float64 `json:"msgs_per_s"`
	Checked     int                `json:"effects_checked"` // messages whose single effect row was verified
}

// Floor is the slower of the two dependencies measured alone.
func (r AMQPRow) Floor() float64 { return min(r.Rate[amqpRaw], r.Rate[pgRaw]) }

type amqpBench struct {
	o      options
	log    io.Writer
	p      *pg
	queues []string
}

func runAMQP(ctx context.Context, o options, log io.Writer) (*AMQPResults, error) {
	res := &AMQPResults{Prefetch: o.prefetch, RawN: 20_000, TxN: 4_000}
	if o.quick {
		res.RawN, res.TxN = 5_000, 1_000
	}
	p, err := openPG(ctx, o.pgURL, 24)
	if err != nil {
		return nil, err
	}
	b := &amqpBench{o: o, log: log, p: p}
	defer b.close()
	for _, n := range amqpConcurrency {
		rates := map[string][]float64{}
		row := AMQPRow{Concurrency: n, Rate: map[string]float64{}}
		for r := range o.runs {
			for _, cell := range amqpCells {
				prof := ""
				if o.profile != "" && r == o.runs-1 && (n == 1 || n == 16) && cell != amqpRaw && cell != pgRaw {
					prof = filepath.Join(o.profile, fmt.Sprintf("amqp-%s-c%d", cell, n))
				}
				var rate float64
				switch cell {
				case amqpRaw:
					rate, err = b.raw(ctx, n, res.RawN)
				case pgRaw:
					rate, err = b.pgTx(ctx, n)
				default:
					rate, err = b.settle(ctx, n, res.TxN, cell == settleOne, prof)
					row.Checked += res.TxN
				}
				if err != nil {
					return nil, fmt.Errorf("%s concurrency %d: %w", cell, n, err)
				}
				fmt.Fprintf(log, "run %d c=%d %s: %.0f msgs/s\n", r+1, n, cell, rate)
				rates[cell] = append(rates[cell], rate)
			}
		}
		for _, c := range amqpCells {
			row.Rate[c] = median(rates[c])
		}
		res.Rows = append(res.Rows, row)
	}
	return res, nil
}

func (b *amqpBench) close() {
	b.closeQueues()
	b.p.close()
}

// closeQueues deletes the queues the runs declared.
func (b *amqpBench) closeQueues() {
	if len(b.queues) > 0 {
		if conn, err := amqp091.Dial(b.o.amqpURL); err == nil {
			if ch, err := conn.Channel(); err == nil {
				for _, q := range b.queues {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
			}
			_ = conn.Close()
		}
	}
}

func (b *amqpBench) config(m amqp.Marshaler) amqp.Config {
	cfg := amqp.NewDurableQueueConfig(b.o.amqpURL)
	cfg.Marshaler = m
	cfg.Consume.Qos.PrefetchCount = b.o.prefetch
	return cfg
}

// prefill declares queue and puts n messages marshalled by m into it,
// published on one channel without confirms, then waits until the broker
// holds all n. It returns the messages' UUIDs.
func (b *amqpBench) prefill(ctx context.Context, queue string, m amqp.Marshaler, n int) error {
	sub, err := amqp.NewSubscriber(b.config(m), watermill.NopLogger{})
	if err != nil {
		return err
	}
	b.queues = append(b.queues, queue)
	err = sub.SubscribeInitialize(queue)
	_ = sub.Close()
	if err != nil {
		return err
	}
	conn, err := amqp091.Dial(b.o.amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"n":`+strconv.Itoa(i)+`}`))
		pub, err := m.Marshal(msg)
		if err != nil {
			return err
		}
		if err := ch.PublishWithContext(ctx, "", queue, false, false, pub); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		if q.Messages >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("queue %s holds %d of %d messages after 2 minutes", queue, q.Messages, n)
		}
		time.Sleep(20 * time.Millisecond) // polling the broker's count
	}
}

// consume runs router with its handlers until count reaches n and returns the
// rate from the first handled message to the last.
func consume(ctx context.Context, router *message.Router, count *atomic.Int64, first *atomic.Int64, n int, prof string) (float64, error) {
	r, _, err := consumeSteady(ctx, router, count, first, n, 0, prof)
	return r, err
}

// consumeSteady is consume with a warm-up: with warm > 0 the clock starts
// when warm messages have been handled (the subscriptions have their
// channels, the pool its connections), and the rate is that of the rest.
// It also returns the processor time spent in the timed window, by whom.
func consumeSteady(ctx context.Context, router *message.Router, count *atomic.Int64, first *atomic.Int64, n, warm int, prof string) (float64, steadyWindow, error) {
	var win steadyWindow
	runDone := make(chan error, 1)
	go func() { runDone <- router.Run(ctx) }()
	defer func() { _ = router.Close(); <-runDone }()
	select {
	case <-router.Running():
	case err := <-runDone:
		return 0, win, fmt.Errorf("router stopped: %w", err)
	}
	stopProf, err := startProfile(prof)
	if err != nil {
		return 0, win, err
	}
	defer stopProf()
	deadline := time.After(5 * time.Minute)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	var (
		start time.Time
		from  int64
		cpu   cpuSnap
	)
	if warm <= 0 {
		cpu = snapCPU()
	}
	for c := count.Load(); c < int64(n); c = count.Load() {
		if warm > 0 && start.IsZero() && c >= int64(warm) {
			start, from, cpu = time.Now(), c, snapCPU()
		}
		select {
		case <-tick.C:
		case <-deadline:
			return 0, win, fmt.Errorf("%d of %d messages handled in 5 minutes", count.Load(), n)
		case err := <-runDone:
			runDone <- err
			return 0, win, fmt.Errorf("router stopped: %v", err)
		case <-ctx.Done():
			return 0, win, ctx.Err()
		}
	}
	end := time.Now()
	win.CPU = cpu.until(snapCPU())
	if start.IsZero() {
		start = time.Unix(0, first.Load())
	}
	win.Messages = n - int(from)
	return float64(win.Messages) / end.Sub(start).Seconds(), win, nil
}

// steadyWindow is the timed part of a run: how many messages it counted
// and the processor time spent meanwhile.
type steadyWindow struct {
	Messages int
	CPU      cpuUse
}

func markFirst(first *atomic.Int64) {
	if first.Load() == 0 {
		first.CompareAndSwap(0, time.Now().UnixNano())
	}
}

// raw consumes n prefilled messages with c competing watermill-amqp
// subscriptions and a no-op handler.
func (b *amqpBench) raw(ctx context.Context, c, n int) (float64, error) {
	r, _, err := b.rawSteady(ctx, c, n, 0)
	return r, err
}

// rawSteady is raw with a warm-up (see consumeSteady), and the processor
// time of its window.
func (b *amqpBench) rawSteady(ctx context.Context, c, n, warm int) (float64, steadyWindow, error) {
	return b.rawSteadyOn(ctx, subWatermill, c, n, warm)
}

// rawSteadyOn is rawSteady through the subscriber kind: c competing
// watermill-amqp subscriptions (subWatermill), or one amqpsub subscription
// with c deliveries in flight (subOne).
func (b *amqpBench) rawSteadyOn(ctx context.Context, kind string, c, n, warm int) (float64, steadyWindow, error) {
	router, count, first, err := b.rawRouter(ctx, kind, c, n)
	if err != nil {
		return 0, steadyWindow{}, err
	}
	return consumeSteady(ctx, router, count, first, n, warm, "")
}

// rawRouter prefills a queue with n messages and returns a router with a
// no-op handler that counts, on c competing watermill-amqp subscriptions
// (kind subWatermill, watermill-amqp's default marshaler) or on one amqpsub
// subscription with c deliveries in flight (subOne, settle's marshaler).
// Its subscriber closes with the router.
func (b *amqpBench) rawRouter(ctx context.Context, kind string, c, n int) (*message.Router, *atomic.Int64, *atomic.Int64, error) {
	queue := "bench_raw_" + randomID()
	var m amqp.Marshaler = amqp.DefaultMarshaler{}
	if kind == subOne {
		am, err := amqpmarshal.New(amqpmarshal.Config{})
		if err != nil {
			return nil, nil, nil, err
		}
		m = am
	}
	if err := b.prefill(ctx, queue, m, n); err != nil {
		return nil, nil, nil, err
	}
	var (
		sub      message.Subscriber
		err      error
		handlers = c
	)
	if kind == subOne {
		sub, err = amqpsub.NewSubscriber(amqpsub.Config{AMQP: b.config(m), InFlight: c}, watermill.NopLogger{})
		handlers = 1
	} else {
		sub, err = amqp.NewSubscriber(b.config(m), watermill.NopLogger{})
	}
	if err != nil {
		return nil, nil, nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, nil, nil, err
	}
	var count, first atomic.Int64
	for i := range handlers {
		router.AddConsumerHandler("raw#"+strconv.Itoa(i+1), queue, sub, func(*message.Message) error {
			markFirst(&first)
			count.Add(1)
			return nil
		})
	}
	return router, &count, &first, nil
}

// pgTx measures BEGIN; INSERT; COMMIT from c goroutines, no broker.
func (b *amqpBench) pgTx(ctx context.Context, c int) (float64, error) {
	effects, err := b.p.effectTable(ctx)
	if err != nil {
		return 0, err
	}
	d := 3 * time.Second
	if b.o.quick {
		d = time.Second
	}
	n, el, err := forDuration(ctx, c, d, "pg-"+randomID()+"-", txOp(b.p, nil, "", effects, txRaw))
	if err != nil {
		return 0, err
	}
	if err := b.p.checkEffects(ctx, effects, n); err != nil {
		return 0, err
	}
	return float64(n) / el.Seconds(), nil
}

// settle consumes n prefilled messages with settle's stack (tracing on, into
// a discarding batch exporter) and a transactional handler that inserts one
// effect row per message, at Concurrency c; then checks that every message
// left exactly one effect row.
func (b *amqpBench) settle(ctx context.Context, c, n int, one bool, prof string) (float64, error) {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return 0, err
	}
	queue := "bench_settle_" + randomID()
	if err := b.prefill(ctx, queue, m, n); err != nil {
		return 0, err
	}
	store, _, err := b.p.dedupeTable(ctx)
	if err != nil {
		return 0, err
	}
	effects, err := b.p.effectTable(ctx)
	if err != nil {
		return 0, err
	}
	cfg := b.config(m)
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	// The pipeline refuses a publisher that does not wait for RabbitMQ's
	// confirmation; nothing is published through this one in the run.
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer pub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) }()
	p, err := pipeline.New(router, pipeline.Config{
		Publisher:   pub,
		Store:       store,
		Concurrency: c,
		Tracing:     []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(mp)},
	})
	if err != nil {
		return 0, err
	}
	insert := "INSERT INTO " + effects + " (msg) VALUES ($1)"
	var count, first atomic.Int64
	hs, err := pipeline.HandleTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(b.p.db, sqldb.Postgres), OneStatement: one},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			markFirst(&first)
			_, err := tx.ExecContext(ctx, insert, msg.UUID)
			return err
		})
	if err != nil {
		return 0, err
	}
	// Innermost: counts the handler calls that committed.
	hs.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				count.Add(1)
			}
			return out, err
		}
	})
	rate, err := consume(ctx, router, &count, &first, n, prof)
	if err != nil {
		return 0, err
	}
	return rate, b.p.checkEffects(ctx, effects, n)
}
