package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/sqldb"
)

// Cells of section anchors: settle beside what a team would otherwise run,
// all consuming a prefilled durable RabbitMQ queue, 16 deliveries in flight.
const (
	ancRaw     = "raw-consume"          // watermill-amqp, 16 subscriptions, no-op handler, no database
	ancRawOne  = "raw-consume-amqpsub"  // one amqpsub subscription, 16 in flight, no-op handler
	ancHand    = "hand-written"         // bare router, 16 subscriptions, BEGIN; key INSERT; effect INSERT; COMMIT
	ancDefault = "settle-default"       // pipeline.HandleTx, TxConfig's defaults, 16 subscriptions
	ancOne     = "settle-one"           // HandleTx with OneStatement, 16 subscriptions
	ancGroup   = "settle-group"         // HandleTx with Batch (the unchanged handler), 16 subscriptions
	ancBatch   = "settle-batch-handler" // HandleBatchTx, one amqpsub subscription, 16 in flight
)

// anchorsCells in the order of the first round; each round rotates them.
var anchorsCells = []string{ancRaw, ancRawOne, ancHand, ancDefault, ancOne, ancGroup, ancBatch}

// anchorsLatencyCells are the cells of the paced runs.
var anchorsLatencyCells = []string{ancHand, ancDefault, ancOne, ancGroup, ancBatch}

// anchorsTargets: each settle cell against its anchor, measured in the same
// round.
var anchorsTargets = []struct {
	cell, anchor string
	target       float64
}{
	{ancDefault, ancHand, 1.0},
	{ancOne, ancHand, 1.2},
	{ancBatch, ancRawOne, 0.8},
	{ancGroup, ancRaw, 0.6},
}

// AnchorsResults: section anchors.
type AnchorsResults struct {
	Messages    int          `json:"messages"`     // per database cell
	Warm        int          `json:"warm_up"`      // of those, not timed
	RawN        int          `json:"raw_messages"` // per raw cell
	RawWarm     int          `json:"raw_warm_up"`
	InFlight    int          `json:"in_flight"`
	Prefetch    int          `json:"prefetch"`
	Rounds      int          `json:"rounds"`
	LatencyRate int          `json:"latency_msgs_per_s"`
	LatencyN    int          `json:"latency_messages"`
	Rows        []AnchorsRow `json:"rows"`
}

// AnchorsRow is one database.
type AnchorsRow struct {
	DB    string               `json:"db"`
	Rate  map[string]float64   `json:"msgs_per_s"`      // median over the rounds
	Rates map[string][]float64 `json:"msgs_per_s_runs"` // every round's, in order
	// CPU is the processor time per 1,000 messages of the round whose
	// rate is nearest the median.
	CPU map[string]CPUPerK `json:"cpu_per_1000"`
	// Statements is the SQL statements sent per message (BEGIN and COMMIT
	// included), median over the rounds; only where counted (PostgreSQL).
	Statements map[string]float64 `json:"statements_per_msg,omitempty"`
	P50        map[string]float64 `json:"p50_ms"` // publish to commit, median over the rounds
	P99        map[string]float64 `json:"p99_ms"`
	// AddedP50 and AddedP99 are, for settle-group and settle-batch-handler,
	// their latency minus settle-one's of the same round, one per round.
	AddedP50 map[string][]float64 `json:"added_p50_ms"`
	AddedP99 map[string][]float64 `json:"added_p99_ms"`
	Checked  int                  `json:"effects_checked"`
}

// anchorsRounds is the section's rounds: -runs if given, else 5 (-quick 2).
func anchorsRounds(o options) int {
	if o.runsGiven {
		return o.runs
	}
	if o.quick {
		return 2
	}
	return 5
}

func runAnchors(ctx context.Context, o options, log io.Writer) (*AnchorsResults, error) {
	o.prefetch = max(o.prefetch, batchPrefetch) // every subscription, the raw ones' too
	res := &AnchorsResults{Messages: 6_000, Warm: 1_000, RawN: 20_000, RawWarm: 4_000, InFlight: batchInFlight,
		Prefetch: o.prefetch, Rounds: anchorsRounds(o), LatencyRate: 500, LatencyN: 1_500}
	if o.quick {
		res.Messages, res.Warm, res.RawN, res.RawWarm, res.LatencyN = 3_000, 500, 10_000, 2_000, 1_000
	}
	b := &amqpBench{o: o, log: log}
	defer b.closeQueues()
	for _, name := range o.anchorsDBs {
		d, err := openAnchorsDB(ctx, o, name)
		if err != nil {
			return nil, err
		}
		row, err := b.anchorsRow(ctx, d, res)
		d.close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		res.Rows = append(res.Rows, row)
	}
	return res, nil
}

// openAnchorsDB opens the database name (postgres or mariadb). PostgreSQL
// is opened as sqlurl opens it (pgx's database/sql driver), with a tracer
// that counts the statements sent.
func openAnchorsDB(ctx context.Context, o options, name string) (*batchDB, error) {
	var (
		db      *sql.DB
		dialect sqldb.Dialect
		stmts   *stmtCounter
		err     error
	)
	switch name {
	case "postgres":
		db, stmts, err = openCountedPG(o.pgURL)
		dialect = sqldb.Postgres
	case "mariadb":
		db, dialect, err = sqlurl.Open(o.mysqlURL)
	default:
		return nil, fmt.Errorf("-anchors-dbs: unknown database %q (have postgres, mariadb)", name)
	}
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(2*batchInFlight + 8)
	db.SetMaxIdleConns(2*batchInFlight + 8)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return &batchDB{name: name, db: db, dialect: dialect, stmts: stmts}, nil
}

// openCountedPG opens url with pgx's database/sql driver and the dialer
// settle's sqlurl uses, counting every statement (BEGIN and COMMIT
// included) in the returned counter.
func openCountedPG(url string) (*sql.DB, *stmtCounter, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, nil, err
	}
	cfg.DialFunc = sqlurl.Dialer().DialContext
	t := &stmtCounter{}
	cfg.Tracer = t
	return stdlib.OpenDB(*cfg), t, nil
}

// stmtCounter is a pgx.QueryTracer that counts Exec and Query calls, in
// all and by SQL text (the section's random table suffixes made one).
type stmtCounter struct {
	n      atomic.Int64
	mu     sync.Mutex
	byText map[string]int64
}

var benchTable = regexp.MustCompile(`bench_([a-z]+)_[0-9a-f]{8}`)

func (t *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	t.n.Add(1)
	t.mu.Lock()
	if t.byText == nil {
		t.byText = map[string]int64{}
	}
	t.byText[data.SQL]++
	t.mu.Unlock()
	return ctx
}

// texts returns the counts by statement, table names normalised.
func (t *stmtCounter) texts() map[string]int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := map[string]int64{}
	for q, n := range t.byText {
		m[benchTable.ReplaceAllString(q, "bench_$1")] += n
	}
	return m
}

// logStatements writes how often each statement of a cell was sent per
// message (the counts of after less before), leaving out those sent for
// fewer than 1 in 100 messages.
func logStatements(log io.Writer, cell string, before, after map[string]int64, n int) {
	type st struct {
		q string
		n int64
	}
	var sts []st
	for q, c := range after {
		if d := c - before[q]; d > 0 && d*100 >= int64(n) { // not the one-offs (DDL, the check)
			sts = append(sts, st{q, d})
		}
	}
	slices.SortFunc(sts, func(a, b st) int { return int(b.n - a.n) })
	for _, s := range sts {
		fmt.Fprintf(log, "  %s: %.2f per message: %s\n", cell, float64(s.n)/float64(n), strings.Join(strings.Fields(s.q), " "))
	}
}

func (t *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// anchorsRow runs the rounds of one database: the throughput cells, then
// the paced latency cells, each round in a rotated order.
func (b *amqpBench) anchorsRow(ctx context.Context, d *batchDB, res *AnchorsResults) (AnchorsRow, error) {
	row := AnchorsRow{DB: d.name, Rate: map[string]float64{}, Rates: map[string][]float64{}, CPU: map[string]CPUPerK{},
		Statements: map[string]float64{}, P50: map[string]float64{}, P99: map[string]float64{},
		AddedP50: map[string][]float64{}, AddedP99: map[string][]float64{}}
	cpus := map[string][]CPUPerK{}
	stmts := map[string][]float64{}
	for r := range res.Rounds {
		for _, cell := range rotate(anchorsCells, r) {
			prof := ""
			if b.o.profile != "" && r == res.Rounds-1 && (cell == ancHand || cell == ancDefault) {
				prof = filepath.Join(b.o.profile, "anchors-"+d.name+"-"+cell)
			}
			var before map[string]int64
			if d.stmts != nil && r == 0 {
				before = d.stmts.texts()
			}
			out, err := b.anchorsCell(ctx, d, cell, res, 0, prof)
			if err != nil {
				return row, fmt.Errorf("round %d %s: %w", r+1, cell, err)
			}
			use := out.win.CPU.perK(out.win.Messages)
			n := res.Messages
			if cell == ancRaw || cell == ancRawOne {
				n = res.RawN
			} else {
				row.Checked += n
			}
			perMsg, counted := float64(out.statements)/float64(n), ""
			if d.stmts != nil {
				counted = fmt.Sprintf("; %.2f statements per message", perMsg)
			}
			fmt.Fprintf(b.log, "round %d %s %s: %.0f msgs/s; CPU ms per 1,000: go %.0f, machine %.0f (broker %.0f, db %.0f)%s\n",
				r+1, d.name, cell, out.rate, use.Go, use.Busy, use.Broker, use.DB, counted)
			if before != nil {
				logStatements(b.log, cell, before, d.stmts.texts(), n)
			}
			row.Rates[cell] = append(row.Rates[cell], out.rate)
			cpus[cell] = append(cpus[cell], use)
			stmts[cell] = append(stmts[cell], perMsg)
		}
	}
	for _, c := range anchorsCells {
		row.Rate[c] = median(slices.Clone(row.Rates[c]))
		near := 0
		for i, v := range row.Rates[c] {
			if abs(v-row.Rate[c]) < abs(row.Rates[c][near]-row.Rate[c]) {
				near = i
			}
		}
		row.CPU[c] = cpus[c][near]
		if d.stmts != nil {
			row.Statements[c] = median(stmts[c])
		}
	}
	p50s, p99s := map[string][]float64{}, map[string][]float64{}
	for r := range res.Rounds {
		got := map[string][2]float64{}
		for _, cell := range rotate(anchorsLatencyCells, r) {
			out, err := b.anchorsCell(ctx, d, cell, res, res.LatencyRate, "")
			if err != nil {
				return row, fmt.Errorf("round %d %s latency: %w", r+1, cell, err)
			}
			row.Checked += res.LatencyN
			p50, p99 := percentile(out.lat, 50), percentile(out.lat, 99)
			got[cell] = [2]float64{p50, p99}
			p50s[cell], p99s[cell] = append(p50s[cell], p50), append(p99s[cell], p99)
			fmt.Fprintf(b.log, "round %d %s %s at %d msgs/s: publish to commit p50 %.2f ms, p99 %.2f ms\n", r+1, d.name, cell, res.LatencyRate, p50, p99)
		}
		for _, cell := range []string{ancGroup, ancBatch} {
			row.AddedP50[cell] = append(row.AddedP50[cell], got[cell][0]-got[ancOne][0])
			row.AddedP99[cell] = append(row.AddedP99[cell], got[cell][1]-got[ancOne][1])
		}
	}
	for _, c := range anchorsLatencyCells {
		row.P50[c], row.P99[c] = median(p50s[c]), median(p99s[c])
	}
	return row, nil
}

// rotate returns xs starting at its (r mod len)th element.
func rotate(xs []string, r int) []string {
	k := r % len(xs)
	return append(slices.Clone(xs[k:]), xs[:k]...)
}

// anchorsCell runs one cell: prefilled (rate 0) or paced at rate.
func (b *amqpBench) anchorsCell(ctx context.Context, d *batchDB, cell string, res *AnchorsResults, rate int, prof string) (runResult, error) {
	n, warm := res.Messages, res.Warm
	if rate > 0 {
		n, warm = res.LatencyN, 0
	}
	switch cell {
	case ancRaw, ancRawOne:
		kind := subWatermill
		if cell == ancRawOne {
			kind = subOne
		}
		var out runResult
		var err error
		out.rate, out.win, err = b.rawSteadyOn(ctx, kind, res.InFlight, res.RawN, res.RawWarm)
		return out, err
	case ancHand:
		return b.handWritten(ctx, d, n, warm, rate, prof)
	}
	s := settleRun{kind: subWatermill, inFlight: res.InFlight, n: n, warm: warm, rate: rate, tracing: true, prof: prof}
	switch cell {
	case ancDefault:
		s.cell = ancDefault
	case ancOne:
		s.cell = batchPerMsg
	case ancGroup:
		s.cell = batchGrouped
	case ancBatch:
		s.cell, s.kind = batchHandler, subOne
	}
	return b.runSettle(ctx, d, s)
}

// handWritten is the exactly-once consumer a team writes by hand, as the
// tutorial teaches it: a bare Watermill router on inFlight competing
// watermill-amqp subscriptions, and per message one transaction that
// records the message's ID in a table of keys (a duplicate inserts no row
// and does nothing else) and inserts the effect row. n messages, prefilled
// (rate 0) or published at rate a second; one effect row per message is
// checked afterwards.
func (b *amqpBench) handWritten(ctx context.Context, d *batchDB, n, warm, rate int, prof string) (runResult, error) {
	var res runResult
	queue := "bench_hand_" + randomID()
	m := amqp.DefaultMarshaler{}
	prefilled := n
	if rate > 0 {
		prefilled = 0
	}
	if err := b.prefill(ctx, queue, m, prefilled); err != nil {
		return res, err
	}
	keys := "bench_keys_" + randomID()
	d.tables = append(d.tables, keys)
	if _, err := d.db.ExecContext(ctx, "CREATE TABLE "+keys+" (message_id VARCHAR(64) PRIMARY KEY)"); err != nil {
		return res, err
	}
	effects, err := d.effectTable(ctx)
	if err != nil {
		return res, err
	}
	cfg := b.config(m)
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	defer sub.Close()
	cfg.Publish.ConfirmDelivery = true // as the settle cells' publisher of the paced runs
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	defer pub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	claim := "INSERT INTO " + keys + " (message_id) VALUES ($1) ON CONFLICT DO NOTHING"
	if d.dialect != sqldb.Postgres {
		claim = "INSERT IGNORE INTO " + keys + " (message_id) VALUES (?)"
	}
	insert := "INSERT INTO " + effects + " (id, msg) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"
	var (
		count, first, id atomic.Int64
		lat              latencies
	)
	handle := func(msg *message.Message) error {
		markFirst(&first)
		ctx := msg.Context()
		tx, err := d.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }() // after Commit, a no-op
		r, err := tx.ExecContext(ctx, claim, msg.UUID)
		if err != nil {
			return err
		}
		claimed, err := r.RowsAffected()
		if err != nil {
			return err
		}
		if claimed == 1 { // 0: a duplicate, done before; commit and ack without the work
			if _, err := tx.ExecContext(ctx, insert, id.Add(1), msg.UUID); err != nil {
				return err
			}
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		lat.record(msg)
		count.Add(1)
		return nil
	}
	for i := range batchInFlight {
		router.AddConsumerHandler("hand#"+strconv.Itoa(i+1), queue, sub, handle)
	}
	if rate > 0 {
		go publishPaced(ctx, pub, queue, n, rate)
	}
	stmts := d.statements()
	res.rate, res.win, err = consumeSteady(ctx, router, &count, &first, n, warm, prof)
	res.statements = d.statements() - stmts
	if err != nil {
		return res, err
	}
	res.lat = lat.all()
	return res, d.checkEffects(ctx, effects, n)
}

// anchorsTable is the section's figures.
func anchorsTable(t *AnchorsResults) string {
	if t == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Throughput, msgs/s, median of %d interleaved rounds (%s messages per database cell, the first %s not timed; %s per raw cell, the first %s not timed), "+
		"statements per message (BEGIN and COMMIT included; counted on PostgreSQL only), and processor time per 1,000 messages of the round nearest the median, ms: this process / the whole machine (2 cores, so at most 2,000 ms per second):\n\n",
		t.Rounds, num(float64(t.Messages)), num(float64(t.Warm)), num(float64(t.RawN)), num(float64(t.RawWarm)))
	b.WriteString("| database | cell | msgs/s | per round | statements per message | CPU, process | CPU, machine |\n|---|---|---:|---|---:|---:|---:|\n")
	for _, r := range t.Rows {
		for _, c := range anchorsCells {
			st := "–"
			if v, ok := r.Statements[c]; ok && c != ancRaw && c != ancRawOne {
				st = strconv.FormatFloat(v, 'f', 2, 64)
			}
			per := make([]string, len(r.Rates[c]))
			for i, v := range r.Rates[c] {
				per[i] = num(v)
			}
			u := r.CPU[c]
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %.0f | %.0f |\n", r.DB, c, num(r.Rate[c]), strings.Join(per, ", "), st, u.Go, u.Busy)
		}
	}
	b.WriteString("\nRatios of the median rates, and the range of the ratios of the two rates of each round:\n\n")
	b.WriteString("| database | settle cell | anchor | ratio | per round | target |\n|---|---|---|---:|---|---:|\n")
	for _, r := range t.Rows {
		for _, g := range anchorsTargets {
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", r.DB, g.cell, g.anchor, x(ratio(r.Rate[g.cell], r.Rate[g.anchor])),
				span(perRound(r.Rates[g.cell], r.Rates[g.anchor])), x(g.target))
		}
	}
	fmt.Fprintf(&b, "\nPublish to commit at a steady %d msgs/s (%s messages per cell), p50 / p99, median of the rounds; batching's MaxWait is %s, and what it adds is read against settle-one of the same round:\n\n",
		t.LatencyRate, num(float64(t.LatencyN)), batchWait)
	b.WriteString("| database |")
	for _, c := range anchorsLatencyCells {
		b.WriteString(" " + c + " |")
	}
	b.WriteString(" settle-group adds, p50 / p99 | settle-batch-handler adds, p50 / p99 |\n|---|" + strings.Repeat("---:|", len(anchorsLatencyCells)+2) + "\n")
	for _, r := range t.Rows {
		b.WriteString("| " + r.DB + " |")
		for _, c := range anchorsLatencyCells {
			fmt.Fprintf(&b, " %.1f / %.1f ms |", r.P50[c], r.P99[c])
		}
		for _, c := range []string{ancGroup, ancBatch} {
			fmt.Fprintf(&b, " %s / %s |", added(r.AddedP50[c]), added(r.AddedP99[c]))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// perRound is a[i]/b[i] for every round both have.
func perRound(a, b []float64) []float64 {
	var rs []float64
	for i := range min(len(a), len(b)) {
		rs = append(rs, ratio(a[i], b[i]))
	}
	return rs
}

// anchorsSummary is the summary table's rows of the section.
func anchorsSummary(b *strings.Builder, t *AnchorsResults, met func(r, t float64) string) {
	if t == nil {
		return
	}
	for _, r := range t.Rows {
		for _, g := range anchorsTargets {
			v := ratio(r.Rate[g.cell], r.Rate[g.anchor])
			fmt.Fprintf(b, "| 4d. RabbitMQ + %s, %s | %s msgs/s | %s msgs/s (%s, same rounds; per round %s) | %s | %s | %s |\n",
				r.DB, g.cell, num(r.Rate[g.cell]), num(r.Rate[g.anchor]), g.anchor, span(perRound(r.Rates[g.cell], r.Rates[g.anchor])),
				x(v), x(g.target), met(v, g.target))
		}
		for _, c := range []string{ancGroup, ancBatch} {
			a := r.AddedP50[c]
			if len(a) == 0 {
				continue
			}
			m := median(slices.Clone(a))
			wait := float64(batchWait) / float64(time.Millisecond)
			verdict := "yes"
			if m > wait {
				verdict = "no (see the section)"
			}
			fmt.Fprintf(b, "| 4d. RabbitMQ + %s, %s at %d msgs/s, latency added at p50 | %.2f ms | settle-one, same round | – | ≤ MaxWait (%s) | %s |\n",
				r.DB, c, t.LatencyRate, m, batchWait, verdict)
		}
	}
}
