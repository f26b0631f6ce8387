package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// Batch cells: RabbitMQ + a database, 16 deliveries in flight.
const (
	batchRawAMQP = "raw-consume"   // watermill-amqp, 16 subscriptions, a no-op handler, no database
	batchRawTx   = "raw-tx"        // BEGIN; INSERT; COMMIT from 16 goroutines, no broker
	batchPerMsg  = "per-message"   // settle HandleTx, one-statement, one commit per message
	batchGrouped = "batched"       // settle HandleTx with Batch: one commit per batch
	batchHandler = "batch-handler" // settle HandleBatchTx: one commit and one multi-row insert per batch
	// batchPaused is settle per message behind a plain pause of MaxWait
	// (latency runs only): what a wait of that length costs on this machine
	// by itself, the round trips after an idle spell included, with no
	// batching.
	batchPaused = "per-message-paused"
)

var batchCells = []string{batchRawAMQP, batchRawTx, batchPerMsg, batchGrouped, batchHandler}

// batchLatencyCells are the cells of the latency runs.
var batchLatencyCells = []string{batchPerMsg, batchPaused, batchGrouped, batchHandler}

// batchInFlight is the concurrency of the batch section: deliveries in
// flight, and goroutines for the raw floor.
const batchInFlight = 16

// How the settle cells of a row consume: batchInFlight watermill-amqp
// subscriptions (each hands the router one delivery at a time), or one
// amqpsub subscription with batchInFlight deliveries in flight.
const (
	subWatermill = "watermill-amqp"
	subOne       = "amqpsub"
)

// batchRows are the rows of each database: how the settle cells consume,
// and how many deliveries they have in flight (the raw cells run at the
// same concurrency). Batches hold at most batchInFlight deliveries in every
// row; the last row has twice as many in flight, so that one batch fills
// while the one before it commits: beyond the targets' condition (16 in
// flight), to show what that setting gives.
var batchRows = []struct {
	kind     string
	inFlight int
}{
	{subWatermill, batchInFlight},
	{subOne, batchInFlight},
	{subOne, 2 * batchInFlight},
}

// batchPrefetch is the least prefetch of the batch section's subscriptions.
// A Watermill subscription handles one delivery at a time whatever its
// prefetch; a prefetch above 1 has the next delivery on the client when a
// batch commits and acks, so the next batch fills without a round trip to
// the broker per subscription. The per-message cell gets the same setting.
const batchPrefetch = 4

// BatchResults: section batch.
type BatchResults struct {
	Messages    int        `json:"messages"`
	Warm        int        `json:"warm_up"` // messages handled before the clock starts
	InFlight    int        `json:"in_flight"`
	Prefetch    int        `json:"prefetch"`
	LatencyRate int        `json:"latency_msgs_per_s"` // publish rate of the latency runs
	Rows        []BatchRow `json:"rows"`
}

// BatchRow is one database: median msgs/s of each cell, and the latency from
// publish to commit of the settle cells.
type BatchRow struct {
	DB string `json:"db"`
	// Subscriber is how the settle cells consumed: subWatermill (also
	// when empty, in results of earlier runs) or subOne.
	Subscriber string `json:"subscriber,omitempty"`
	// InFlight is the deliveries in flight of the settle cells and the
	// concurrency of the raw ones; 0 (results of earlier runs) means
	// batchInFlight. Batches hold at most batchInFlight in every row.
	InFlight int                `json:"in_flight,omitempty"`
	Rate     map[string]float64 `json:"msgs_per_s"`
	// Rates holds each cell's rate in every round, in order: the cells of
	// a round ran one after the other, so ratios are read per round too.
	Rates map[string][]float64 `json:"msgs_per_s_runs,omitempty"`
	P50   map[string]float64   `json:"p50_ms"` // median over the rounds
	P99   map[string]float64   `json:"p99_ms"`
	// Added is, per latency cell other than per-message, how much later
	// than the per-message cell of the same round its messages committed,
	// at p50 and at p99: one value per round, in order.
	AddedP50 map[string][]float64 `json:"added_p50_ms,omitempty"`
	AddedP99 map[string][]float64 `json:"added_p99_ms,omitempty"`
	CPU      map[string]CPUPerK   `json:"cpu_per_1000"` // of the run nearest the median
	Checked  int                  `json:"effects_checked"`
}

// batchDB is the database of one row: its handle, the SQL it needs, and the
// tables to drop.
type batchDB struct {
	name    string
	db      *sql.DB
	dialect sqldb.Dialect
	tables  []string
	// stmts counts the statements sent on db, where it is counted (see
	// openCountedPG); nil otherwise.
	stmts *stmtCounter
}

// statements is how many statements db has sent so far; 0 if uncounted.
func (d *batchDB) statements() int64 {
	if d.stmts == nil {
		return 0
	}
	return d.stmts.n.Load()
}

func (d *batchDB) ph(n int) string {
	if d.dialect == sqldb.Postgres {
		return "$" + strconv.Itoa(n)
	}
	return "?"
}

func (d *batchDB) effectTable(ctx context.Context) (string, error) {
	name := "bench_effects_" + randomID()
	d.tables = append(d.tables, name)
	_, err := d.db.ExecContext(ctx, "CREATE TABLE "+name+" (id BIGINT NOT NULL, msg VARCHAR(64) NOT NULL)")
	return name, err
}

func (d *batchDB) store(ctx context.Context) (*dedupe.SQLStore[*sql.Tx], error) {
	name := "bench_claims_" + randomID()
	store, err := dedupe.NewSQLStore(sqldb.Std(d.db, d.dialect), dedupe.SQLConfig{Table: name})
	if err != nil {
		return nil, err
	}
	ddl := store.Schema()
	d.tables = append(d.tables, name)
	for _, s := range ddl {
		if _, err := d.db.ExecContext(ctx, s); err != nil {
			return nil, err
		}
	}
	return store, nil
}

func (d *batchDB) checkEffects(ctx context.Context, table string, want int) error {
	var rows, distinct int
	if err := d.db.QueryRowContext(ctx, "SELECT COUNT(*), COUNT(DISTINCT msg) FROM "+table).Scan(&rows, &distinct); err != nil {
		return err
	}
	if rows != want || distinct != want {
		return fmt.Errorf("%s: %d effect rows for %d distinct messages, want exactly one for each of %d", table, rows, distinct, want)
	}
	return nil
}

func (d *batchDB) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, t := range d.tables {
		_, _ = d.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t)
	}
	_ = d.db.Close()
}

func runBatch(ctx context.Context, o options, log io.Writer) (*BatchResults, error) {
	// Every subscription of the section, the raw consume's too, has the
	// same prefetch.
	o.prefetch = max(o.prefetch, batchPrefetch)
	res := &BatchResults{Messages: 20_000, InFlight: batchInFlight, Prefetch: o.prefetch, LatencyRate: 500}
	if o.quick {
		res.Messages = 4_000
	}
	// The first fifth is not timed: it opens the subscriptions' channels and
	// the pool's connections, which a run of a few seconds would otherwise
	// count against settle's cells but not against the raw transaction's.
	res.Warm = res.Messages / 5
	b := &amqpBench{o: o, log: log}
	defer b.closeQueues()
	for _, target := range []struct{ name, url string }{{"postgres", o.pgURL}, {"mariadb", o.mysqlURL}} {
		db, dialect, err := sqlurl.Open(target.url)
		if err != nil {
			return nil, err
		}
		db.SetMaxOpenConns(2*batchInFlight + 8)
		db.SetMaxIdleConns(2*batchInFlight + 8)
		d := &batchDB{name: target.name, db: db, dialect: dialect}
		for _, spec := range batchRows {
			row, err := b.batchRow(ctx, d, res, spec.kind, spec.inFlight)
			if err != nil {
				d.close()
				return nil, fmt.Errorf("%s, %s, %d in flight: %w", target.name, spec.kind, spec.inFlight, err)
			}
			res.Rows = append(res.Rows, row)
		}
		d.close()
	}
	return res, nil
}

func (b *amqpBench) batchRow(ctx context.Context, d *batchDB, res *BatchResults, kind string, inFlight int) (BatchRow, error) {
	row := BatchRow{DB: d.name, Subscriber: kind, InFlight: inFlight, Rate: map[string]float64{}, P50: map[string]float64{}, P99: map[string]float64{}, CPU: map[string]CPUPerK{}}
	rates := map[string][]float64{}
	cpus := map[string][]CPUPerK{}
	for r := range b.o.runs {
		for _, cell := range batchCells {
			var (
				rate float64
				win  steadyWindow
				err  error
			)
			switch cell {
			case batchRawTx:
				rate, win, err = b.rawTx(ctx, d, inFlight)
			case batchRawAMQP:
				rate, win, err = b.rawSteady(ctx, inFlight, res.Messages, res.Warm)
			default:
				rate, win, _, err = b.batchSettle(ctx, d, kind, inFlight, cell, res.Messages, res.Warm, 0)
				row.Checked += res.Messages
			}
			if err != nil {
				return row, fmt.Errorf("%s: %w", cell, err)
			}
			use := win.CPU.perK(win.Messages)
			fmt.Fprintf(b.log, "run %d %s %s: %.0f msgs/s; CPU ms per 1,000: go %.0f, broker %.0f, db %.0f, machine %.0f\n",
				r+1, row.label(), cell, rate, use.Go, use.Broker, use.DB, use.Busy)
			rates[cell] = append(rates[cell], rate)
			cpus[cell] = append(cpus[cell], use)
		}
	}
	row.Rates = rates
	for _, c := range batchCells {
		row.Rate[c] = median(slices.Clone(rates[c])) // median sorts
		// The CPU use of the run whose rate is nearest the median.
		near := 0
		for i, r := range rates[c] {
			if math.Abs(r-row.Rate[c]) < math.Abs(rates[c][near]-row.Rate[c]) {
				near = i
			}
		}
		row.CPU[c] = cpus[c][near]
	}
	// Latency at a steady publish rate well below either mode's capacity,
	// the cells in turn within each round, so that what batching adds is
	// read against the per-message cell of the same round.
	n := res.LatencyRate * 4
	p50s, p99s := map[string][]float64{}, map[string][]float64{}
	row.AddedP50, row.AddedP99 = map[string][]float64{}, map[string][]float64{}
	for r := range b.o.runs {
		for _, cell := range batchLatencyCells {
			_, _, lat, err := b.batchSettle(ctx, d, kind, inFlight, cell, n, 0, res.LatencyRate)
			if err != nil {
				return row, fmt.Errorf("%s latency: %w", cell, err)
			}
			row.Checked += n
			p50, p99 := percentile(lat, 50), percentile(lat, 99)
			p50s[cell], p99s[cell] = append(p50s[cell], p50), append(p99s[cell], p99)
			fmt.Fprintf(b.log, "run %d %s %s at %d msgs/s: publish to commit p50 %.2f ms, p99 %.2f ms\n", r+1, row.label(), cell, res.LatencyRate, p50, p99)
			if cell != batchPerMsg {
				row.AddedP50[cell] = append(row.AddedP50[cell], p50-p50s[batchPerMsg][r])
				row.AddedP99[cell] = append(row.AddedP99[cell], p99-p99s[batchPerMsg][r])
			}
		}
	}
	for _, cell := range batchLatencyCells {
		row.P50[cell], row.P99[cell] = median(p50s[cell]), median(p99s[cell])
	}
	return row, nil
}

// batchWait is the MaxWait of the batching cells (the default).
const batchWait = 2 * time.Millisecond // pipeline.BatchConfig.MaxWait's default

// rawTx measures BEGIN; INSERT; COMMIT from inFlight goroutines.
func (b *amqpBench) rawTx(ctx context.Context, d *batchDB, inFlight int) (float64, steadyWindow, error) {
	var win steadyWindow
	effects, err := d.effectTable(ctx)
	if err != nil {
		return 0, win, err
	}
	insert := "INSERT INTO " + effects + " (id, msg) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"
	dur := 3 * time.Second
	if b.o.quick {
		dur = time.Second
	}
	var id atomic.Int64
	cpu := snapCPU()
	n, el, err := forDuration(ctx, inFlight, dur, "raw-"+randomID()+"-", func(ctx context.Context, key string) error {
		tx, err := d.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, insert, id.Add(1), key); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	})
	win.CPU, win.Messages = cpu.until(snapCPU()), n
	if err != nil {
		return 0, win, err
	}
	return float64(n) / el.Seconds(), win, d.checkEffects(ctx, effects, n)
}

// batchSettle consumes n messages from RabbitMQ with a settle transactional
// handler (one-statement per message, or batched) with inFlight deliveries
// in flight (inFlight watermill-amqp subscriptions, or one amqpsub
// subscription), then checks one effect row per message. With rate 0 the
// queue is prefilled and the result is the throughput; with a rate the
// messages are published at that rate while the router runs, and the
// latencies from publish to commit are returned. The first warm messages of
// a throughput run are not timed.
func (b *amqpBench) batchSettle(ctx context.Context, d *batchDB, kind string, inFlight int, cell string, n, warm, rate int) (float64, steadyWindow, []float64, error) {
	prof := ""
	if b.o.profile != "" && rate == 0 {
		prof = filepath.Join(b.o.profile, "batch-"+d.name+"-"+kind+"-"+cell)
	}
	r, err := b.runSettle(ctx, d, settleRun{kind: kind, inFlight: inFlight, cell: cell, n: n, warm: warm, rate: rate, prof: prof})
	return r.rate, r.win, r.lat, err
}

// settleRun is one run of a settle transactional handler on RabbitMQ.
type settleRun struct {
	kind     string // subWatermill or subOne
	inFlight int    // subscriptions (subWatermill) or InFlight (subOne)
	// cell is the handler: batchPerMsg (one-statement), batchPaused,
	// batchGrouped, batchHandler, or ancDefault (TxConfig's defaults).
	cell          string
	n, warm, rate int
	tracing       bool   // keep pipeline's tracing middleware (global provider); off otherwise
	prof          string // CPU profile into this path prefix
}

// runResult is what a run measured: the throughput and its window (rate
// 0), or the latencies from publish to commit in ms (paced runs), and the
// SQL statements sent while the router ran, when the database counts them.
type runResult struct {
	rate       float64
	win        steadyWindow
	lat        []float64
	statements int64
}

// runSettle runs s (see batchSettle) and checks one effect row per message.
func (b *amqpBench) runSettle(ctx context.Context, d *batchDB, s settleRun) (runResult, error) {
	var res runResult
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return res, err
	}
	queue := "bench_batch_" + randomID()
	prefilled := s.n
	if s.rate > 0 {
		prefilled = 0
	}
	if err := b.prefill(ctx, queue, m, prefilled); err != nil {
		return res, err
	}
	store, err := d.store(ctx)
	if err != nil {
		return res, err
	}
	effects, err := d.effectTable(ctx)
	if err != nil {
		return res, err
	}
	cfg := b.config(m)
	cfg.Consume.Qos.PrefetchCount = max(b.o.prefetch, batchPrefetch)
	var sub message.Subscriber
	concurrency := s.inFlight
	if s.kind == subOne {
		// One subscription, all the deliveries in flight on it; the
		// prefetch is raised to 4 × InFlight.
		sub, err = amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg, InFlight: s.inFlight}, watermill.NopLogger{})
		concurrency = 1
	} else {
		sub, err = amqp.NewSubscriber(cfg, watermill.NopLogger{})
	}
	if err != nil {
		return res, err
	}
	defer sub.Close()
	// The pipeline refuses a publisher that does not wait for RabbitMQ's
	// confirmation; nothing is published through this one in the run.
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	defer pub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, Concurrency: concurrency, DisableTracing: !s.tracing})
	if err != nil {
		return res, err
	}
	insert := "INSERT INTO " + effects + " (id, msg) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"
	var (
		count, first, id atomic.Int64
		lat              latencies
		hs               pipeline.Handlers
	)
	perMessage := func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		markFirst(&first)
		_, err := tx.ExecContext(ctx, insert, id.Add(1), msg.UUID)
		return err
	}
	batched := pipeline.BatchConfig{MaxSize: batchInFlight}
	switch s.cell {
	case ancDefault:
		hs, err = pipeline.HandleTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect)}, perMessage)
	case batchPerMsg:
		hs, err = pipeline.HandleTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), OneStatement: true}, perMessage)
	case batchPaused:
		hs, err = pipeline.HandleTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), OneStatement: true}, perMessage)
		if err == nil {
			// Before the handler, so before its BEGIN, as a batch's wait is
			// before its claim.
			hs.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					time.Sleep(batchWait)
					return h(msg)
				}
			})
		}
	case batchGrouped:
		hs, err = pipeline.HandleTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), Batch: batched}, perMessage)
	case batchHandler:
		// The same rows, written by one multi-row insert per batch.
		hs, err = pipeline.HandleBatchTx(p, "tx", queue, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(d.db, d.dialect), Batch: batched}, func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			markFirst(&first)
			var q strings.Builder
			q.WriteString("INSERT INTO " + effects + " (id, msg) VALUES ")
			args := make([]any, 0, 2*len(msgs))
			for i, msg := range msgs {
				if i > 0 {
					q.WriteString(", ")
				}
				q.WriteString("(" + d.ph(2*i+1) + ", " + d.ph(2*i+2) + ")")
				args = append(args, id.Add(1), msg.UUID)
			}
			_, err := tx.ExecContext(ctx, q.String(), args...)
			return err
		})
	default:
		err = fmt.Errorf("unknown settle cell %q", s.cell)
	}
	if err != nil {
		return res, err
	}
	// Innermost: the handler has returned, so its transaction committed.
	hs.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				lat.record(msg)
				count.Add(1)
			}
			return out, err
		}
	})
	if s.rate > 0 {
		go publishPaced(ctx, pub, queue, s.n, s.rate)
	}
	stmts := d.statements()
	res.rate, res.win, err = consumeSteady(ctx, router, &count, &first, s.n, s.warm, s.prof)
	res.statements = d.statements() - stmts
	if err != nil {
		return res, err
	}
	res.lat = lat.all()
	return res, d.checkEffects(ctx, effects, s.n)
}

// sentHeader is the metadata key of a paced message's publish time, in
// nanoseconds since the epoch.
const sentHeader = "bench_sent_ns"

// publishPaced publishes n messages to queue at rate a second, each with
// its publish time in sentHeader, until done or ctx ends.
func publishPaced(ctx context.Context, pub message.Publisher, queue string, n, rate int) {
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := 0; i < n && ctx.Err() == nil; i++ {
		<-tick.C
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		msg.Metadata.Set(sentHeader, strconv.FormatInt(time.Now().UnixNano(), 10))
		_ = pub.Publish(queue, msg)
	}
}

// latencies collects, for the messages that carry sentHeader, the time
// from their publish to record (after their commit), in ms.
type latencies struct {
	mu sync.Mutex
	ms []float64
}

func (l *latencies) record(msg *message.Message) {
	sent, err := strconv.ParseInt(msg.Metadata.Get(sentHeader), 10, 64)
	if err != nil {
		return
	}
	l.mu.Lock()
	l.ms = append(l.ms, float64(time.Now().UnixNano()-sent)/1e6)
	l.mu.Unlock()
}

func (l *latencies) all() []float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ms)
}

func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(float64(len(s)-1) * p / 100)
	return s[i]
}

func batchTable(t *BatchResults) string {
	if t == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Throughput, msgs/s (median of the runs; %d messages per settle run, the first %d not timed):\n\n", t.Messages, t.Warm)
	b.WriteString("| database | raw watermill-amqp consume | raw BEGIN; INSERT; COMMIT | settle per message | settle batched | settle batch handler | batched / per message | batch handler / per message | batched / raw tx | batch handler / raw tx | batch handler / raw consume | effects checked |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range t.Rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.label(),
			num(r.Rate[batchRawAMQP]), num(r.Rate[batchRawTx]), num(r.Rate[batchPerMsg]), num(r.Rate[batchGrouped]), num(r.Rate[batchHandler]),
			x(ratio(r.Rate[batchGrouped], r.Rate[batchPerMsg])), x(ratio(r.Rate[batchHandler], r.Rate[batchPerMsg])),
			x(ratio(r.Rate[batchGrouped], r.Rate[batchRawTx])), x(ratio(r.Rate[batchHandler], r.Rate[batchRawTx])),
			x(ratio(r.Rate[batchHandler], r.Rate[batchRawAMQP])), num(float64(r.Checked)))
	}
	fmt.Fprintf(&b, "\nPublish to commit at a steady %d msgs/s, p50 / p99 (median of the runs); \"per message after a pause\" is the per-message cell with a plain sleep of the batches' maximum wait (%s) before each message's transaction:\n\n",
		t.LatencyRate, batchWait)
	b.WriteString("| database | settle per message | per message after a pause | settle batched | settle batch handler |\n|---|---:|---:|---:|---:|\n")
	for _, r := range t.Rows {
		b.WriteString("| " + r.label() + " |")
		for _, c := range batchLatencyCells {
			fmt.Fprintf(&b, " %.1f / %.1f ms |", r.P50[c], r.P99[c])
		}
		b.WriteString("\n")
	}
	b.WriteString("\nWhat each adds to the per-message cell of the same run, at p50 and at p99 (median of the runs, and their range):\n\n")
	b.WriteString("| database | pause, p50 | pause, p99 | batched, p50 | batched, p99 | batch handler, p50 | batch handler, p99 |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range t.Rows {
		b.WriteString("| " + r.label() + " |")
		for _, c := range batchLatencyCells[1:] {
			fmt.Fprintf(&b, " %s | %s |", added(r.AddedP50[c]), added(r.AddedP99[c]))
		}
		b.WriteString("\n")
	}
	b.WriteString("\nProcessor time per 1,000 messages in the timed part of the median run, ms: this process (settle and the clients) / RabbitMQ / the database server / the whole machine (2 cores, so at most 2,000 ms per second):\n\n")
	b.WriteString("| database |")
	for _, c := range batchCells {
		b.WriteString(" " + c + " |")
	}
	b.WriteString("\n|---|" + strings.Repeat("---:|", len(batchCells)) + "\n")
	for _, r := range t.Rows {
		b.WriteString("| " + r.label() + " |")
		for _, c := range batchCells {
			u := r.CPU[c]
			fmt.Fprintf(&b, " %.0f / %.0f / %.0f / %.0f |", u.Go, u.Broker, u.DB, u.Busy)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// added formats what batching added over the runs: the median, and the
// range when there was more than one run.
func added(xs []float64) string {
	if len(xs) == 0 {
		return "–"
	}
	lo, hi := slices.Min(xs), slices.Max(xs)
	m := median(slices.Clone(xs))
	if len(xs) == 1 {
		return fmt.Sprintf("%.2f ms", m)
	}
	return fmt.Sprintf("%.2f ms (%.2f–%.2f)", m, lo, hi)
}

// batchTargets are the floors the batch handler is held against: the cell,
// its name in the summary table and in the verdict, and the target ratio.
var batchTargets = []struct {
	floor, name, short string
	target             float64
}{
	{batchPerMsg, "settle per message", "the per-message handler", targetBatchPerMsg},
	{batchRawTx, "raw BEGIN; INSERT; COMMIT", "the raw transaction", targetBatchRawTx},
	{batchRawAMQP, "raw watermill-amqp consume; stretch", "the raw consume", targetBatchConsume},
}

// batchVerdict says, for each database, where the batch handler stands
// against the targets of the section: the ratio of the medians, and the
// range of the ratios within each round.
func batchVerdict(t *BatchResults) string {
	if t == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	for _, r := range t.Rows {
		var parts, rounds []string
		for _, c := range batchTargets {
			v := ratio(r.Rate[batchHandler], r.Rate[c.floor])
			verdict := "met"
			if v < c.target {
				verdict = "not met"
			}
			if c.floor == batchRawAMQP {
				verdict = "stretch " + verdict
			}
			if r.inFlight() != batchInFlight {
				side := "above"
				if v < c.target {
					side = "below"
				}
				verdict = fmt.Sprintf("%s the %s target, which is for %d in flight", side, x(c.target), batchInFlight)
			}
			parts = append(parts, fmt.Sprintf("%s %s (%s)", x(v), c.short, verdict))
			h, f := r.Rates[batchHandler], r.Rates[c.floor]
			if len(h) > 1 && len(h) == len(f) {
				per := make([]float64, len(h))
				for i := range h {
					per[i] = ratio(h[i], f[i])
				}
				rounds = append(rounds, span(per))
			}
		}
		fmt.Fprintf(&b, "- **%s**: %s.", r.label(), strings.Join(parts, ", "))
		if len(rounds) > 0 {
			fmt.Fprintf(&b, " Per round: %s.", strings.Join(rounds, ", "))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// label names the row: its database, and how the settle cells consumed.
func (r BatchRow) label() string {
	if r.Subscriber == subOne {
		if r.inFlight() != batchInFlight {
			return fmt.Sprintf("%s, one amqpsub subscription, %d in flight", r.DB, r.inFlight())
		}
		return r.DB + ", one amqpsub subscription"
	}
	return fmt.Sprintf("%s, %d watermill-amqp subscriptions", r.DB, r.inFlight())
}

// inFlight is the row's InFlight, batchInFlight in results of earlier runs.
func (r BatchRow) inFlight() int {
	if r.InFlight == 0 {
		return batchInFlight
	}
	return r.InFlight
}
