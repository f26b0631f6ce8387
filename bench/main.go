// Command bench is settle's one benchmark harness: it measures settle beside
// the floors it is judged against (the bare Watermill router, raw SQL
// statements, raw RabbitMQ consume, raw PostgreSQL transactions) in one run,
// prints the figures and their ratios, and can regenerate docs/benchmarks.md.
//
// The harness is a module of its own (bench/go.mod, which replaces settle by
// the directory above it), so that its dependencies, River among them, stay
// out of the library's go.mod. It runs from its directory:
//
//	cd bench
//	go run .                        # everything, about 10 minutes
//	go run . -quick                 # smaller runs, about 2 minutes
//	go run . -only stack,txcost     # some sections
//	go run . -write ../docs/benchmarks.md
//	go run . -only stack -profile DIR  # CPU and alloc profiles into DIR
//	go run . -render -write ../docs/benchmarks.md # the document from results.json
//
// (or, from the repository's root, go -C bench run . ...).
//
// Sections (-only takes a comma-separated list):
//
//   - stack: bare Watermill router on GoChannel vs settle's stack (memory
//     store), tracing off and on.
//   - stores: dedupe stores vs their raw-SQL floor on PostgreSQL, MariaDB and
//     SQLite at 1/4/16 goroutines (runs `go test -bench ClaimConfirm` of
//     settle's ./dedupe, in the directory above, and reads its output).
//   - txcost: PostgreSQL transactional dedupe, one statement vs the default
//     mode vs a raw BEGIN; INSERT; COMMIT.
//   - pgx: PostgreSQL through pgx directly (dedupe.SQLStore on sqldb.Pgx, the pgx
//     transactional handler) beside database/sql and the raw pgx floor:
//     claim+confirm, duplicate claims, one-statement and default
//     transactional handlers, at 1/4/16 goroutines; batch handlers (group
//     commit of the deliveries in flight) at 4/16.
//   - amqp: RabbitMQ end to end: raw watermill-amqp consume vs settle's stack
//     with a PostgreSQL transactional handler, at Concurrency 1..16, with an
//     exactly-once check of the effect rows.
//   - batch: RabbitMQ + PostgreSQL and + MariaDB, 16 deliveries in flight:
//     raw BEGIN; INSERT; COMMIT vs settle's transactional handler with one
//     commit per message vs with group commit (TxConfig.Batch), throughput
//     and publish-to-commit latency, with an exactly-once check.
//   - brokers: per broker (RabbitMQ, NATS JetStream, Redis Streams,
//     watermill-sql on PostgreSQL), the raw consume-and-ack of that broker
//     vs settle's stack with a PostgreSQL transactional handler, per
//     message and batched (group commit), 16 subscriptions, in interleaved
//     rounds, with processor time per message (-quick: about a minute).
//     NATS and Redis are read from SETTLE_NATS_URL and SETTLE_REDIS_URL.
//   - anchors: RabbitMQ + PostgreSQL (-anchors-dbs adds MariaDB), 16
//     deliveries in flight: settle beside the anchors a team would otherwise
//     choose, in interleaved rounds (5, -quick 2; cell order rotated): the
//     raw consume (16 watermill-amqp subscriptions; one amqpsub
//     subscription), the hand-written exactly-once consumer (a table of
//     keys and the effect in one transaction, bare router), and settle's
//     default, one-statement, group-commit and batch-handler modes; msgs/s,
//     processor time per message, statements per message, and latency from
//     publish to commit at 500 msgs/s, with an exactly-once check.
//   - outbox: runs ./outbox (a separate command) and includes its table.
//   - growth: per-message cost as the message count and the dedupe table
//     grow, and the cost of Prune on a million confirmed keys.
//   - attempts: the retry middleware's memory of failing messages, full at
//     10,000 and 100,000 distinct messages: per-delivery latency, and the
//     slowest successful delivery running beside them (no stall).
//   - parked: the parked-message store's list and group pages on a table of
//     a million rows (-quick: 131,072), on PostgreSQL and MariaDB.
//   - nats: NATS JetStream with a 1 ms handler: watermill-nats' subscriber
//     (ManualAck) vs settle's (natsjs + pipeline, memory store) at
//     SubscribersCount 1/4/16, and a nats.go pull consumer fetching 1/4/16
//     at once: msgs/s and the most handlers seen in flight.
//   - redis: Redis Streams + PostgreSQL, 16 deliveries in flight: 16
//     subscriptions of watermill-redisstream's subscriber vs one redissub
//     subscription (XREADGROUP COUNT 16), a raw no-op consume vs settle's
//     transactional handler per message and with group commit, with an
//     exactly-once check. Not in docs/benchmarks.md: docs/brokers.md
//     quotes it.
//   - scale: claim+confirm latency on a claims table already holding 1M and
//     10M confirmed keys (-quick: 100,000), and the prune of a day of them
//     while claims go on, on PostgreSQL and MariaDB.
//
// The servers are read from SETTLE_POSTGRES_URL, SETTLE_MYSQL_URL,
// SETTLE_AMQP_URL and SETTLE_REDIS_URL, defaulting to the local services on 127.0.0.1.
//
// With -write, the results of the sections run are merged into a JSON file
// beside the harness (results.json, -results) and the whole document is
// regenerated from it, so a run of one section keeps the others' figures.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"time"
)

// sections in the order they run and appear in the document.
var sections = []string{"stack", "stores", "txcost", "pgx", "amqp", "batch", "brokers", "anchors", "outbox", "growth", "attempts", "parked", "scale", "nats", "redis"}

type options struct {
	quick    bool
	only     map[string]bool
	write    string
	results  string
	profile  string
	runs     int
	pgURL    string
	mysqlURL string
	amqpURL  string
	prefetch int
	maxLoad  float64
	// scaleLayouts are the claims table layouts the scale section measures.
	scaleLayouts []string
	scaleDBs     []string // the databases it measures them on
	scaleSizes   []int    // the sizes; none: its defaults
	// runsGiven says -runs was given: the anchors section takes it for its
	// rounds instead of its own default.
	runsGiven  bool
	anchorsDBs []string // the databases the anchors section measures on
}

// settleDir is settle's module, relative to the harness's: the directory
// bench/go.mod replaces github.com/settle-go/settle by. The stores section
// runs settle's own dedupe benchmarks there.
const settleDir = ".."

func main() {
	o, err := parseFlags(os.Args[1:])
	if err == nil {
		err = checkDir()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// checkDir makes sure the harness runs in its own directory, which its
// relative paths (results.json, ./outbox, settleDir) are taken from.
func checkDir() error {
	b, err := os.ReadFile("go.mod")
	if err == nil && slices.Contains(strings.Split(string(b), "\n"), "module github.com/settle-go/settle/bench") {
		return nil
	}
	return errors.New("run the harness from its directory: cd bench && go run . (or go -C bench run . from the repository's root)")
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func parseFlags(args []string) (options, error) {
	var o options
	var only string
	var render bool
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.BoolVar(&o.quick, "quick", false, "smaller runs (about 2 minutes in all)")
	fs.StringVar(&only, "only", "", "comma-separated sections to run: "+strings.Join(sections, ","))
	fs.StringVar(&o.write, "write", "", "regenerate this markdown file (../docs/benchmarks.md) from the results")
	fs.StringVar(&o.results, "results", "results.json", "JSON file the results are merged into with -write")
	fs.BoolVar(&render, "render", false, "run nothing: regenerate the -write file from the -results file")
	fs.StringVar(&o.profile, "profile", "", "write CPU and alloc profiles of settle's runs into this directory")
	fs.IntVar(&o.runs, "runs", 0, "runs per cell, the median is reported (default 3, 1 with -quick)")
	fs.IntVar(&o.prefetch, "prefetch", 1, "RabbitMQ prefetch count per subscription (each has its own channel)")
	fs.Float64Var(&o.maxLoad, "max-load", 0, "wait (up to 10 minutes) until the 1-minute load average is below this; 0 does not wait")
	var layouts, dbs, sizes, anchorsDBs string
	fs.StringVar(&anchorsDBs, "anchors-dbs", "postgres", "the databases the anchors section measures on: postgres, mariadb, or both comma-separated")
	fs.StringVar(&dbs, "scale-dbs", "postgres,mariadb", "the databases the scale section measures on (the others' figures are kept from -results)")
	fs.StringVar(&sizes, "scale-sizes", "", "the table sizes the scale section measures, comma-separated (default 1000000,10000000; -quick 100000)")
	fs.StringVar(&layouts, "scale-layouts", "table,partitioned", "the claims table layouts the scale section measures (the others' figures are kept from -results)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	fs.Visit(func(f *flag.Flag) { o.runsGiven = o.runsGiven || f.Name == "runs" })
	o.anchorsDBs = strings.Split(anchorsDBs, ",")
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.scaleLayouts, o.scaleDBs = strings.Split(layouts, ","), strings.Split(dbs, ",")
	if sizes != "" {
		for f := range strings.SplitSeq(sizes, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < scaleDays {
				return o, fmt.Errorf("-scale-sizes: %q is not a size", f)
			}
			o.scaleSizes = append(o.scaleSizes, n)
		}
	}
	o.only = map[string]bool{}
	if render {
		if o.write == "" || only != "" {
			return o, errors.New("-render needs -write and no -only")
		}
	} else if only == "" {
		for _, s := range sections {
			o.only[s] = true
		}
	} else {
		for s := range strings.SplitSeq(only, ",") {
			if !slices.Contains(sections, s) {
				return o, fmt.Errorf("-only: unknown section %q (have %s)", s, strings.Join(sections, ","))
			}
			o.only[s] = true
		}
	}
	if o.runs == 0 {
		o.runs = 3
		if o.quick {
			o.runs = 1
		}
	}
	if o.runs < 0 || o.prefetch < 1 {
		return o, errors.New("-runs must be >= 0 and -prefetch >= 1")
	}
	o.pgURL = env("SETTLE_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	o.mysqlURL = env("SETTLE_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
	o.amqpURL = env("SETTLE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	return o, nil
}

// Results is everything a run measured; the document is generated from it.
type Results struct {
	Machine  Machine          `json:"machine"`
	Stack    *StackResults    `json:"stack,omitempty"`
	Stores   *StoresResults   `json:"stores,omitempty"`
	TxCost   *TxCostResults   `json:"txcost,omitempty"`
	Pgx      *PgxResults      `json:"pgx,omitempty"`
	AMQP     *AMQPResults     `json:"amqp,omitempty"`
	Batch    *BatchResults    `json:"batch,omitempty"`
	Brokers  *BrokersResults  `json:"brokers,omitempty"`
	Anchors  *AnchorsResults  `json:"anchors,omitempty"`
	Outbox   *OutboxResults   `json:"outbox,omitempty"`
	Growth   *GrowthResults   `json:"growth,omitempty"`
	Attempts *AttemptsResults `json:"attempts,omitempty"`
	Parked   *ParkedResults   `json:"parked,omitempty"`
	NATS     *NATSResults     `json:"nats,omitempty"`
	Redis    *RedisResults    `json:"redis,omitempty"`
	Scale    *ScaleResults    `json:"scale,omitempty"`
	Runs     map[string]RunAt `json:"runs"` // section -> when and how it ran
}

// RunAt records the conditions of one section's run.
type RunAt struct {
	Date  string  `json:"date"`
	Quick bool    `json:"quick"`
	Runs  int     `json:"runs"`
	Load  float64 `json:"load"` // 1-minute load average at the start
}

func run(ctx context.Context, o options, stdout, stderr io.Writer) error {
	if o.maxLoad > 0 {
		waitQuiet(ctx, o.maxLoad, stderr)
	}
	res := &Results{Runs: map[string]RunAt{}}
	if o.write != "" {
		if b, err := os.ReadFile(o.results); err == nil {
			if err := json.Unmarshal(b, res); err != nil {
				return fmt.Errorf("%s: %w", o.results, err)
			}
			if res.Runs == nil {
				res.Runs = map[string]RunAt{}
			}
		}
	}
	if len(o.only) > 0 || res.Machine.CPUs == 0 {
		res.Machine = describeMachine(ctx, o)
		fmt.Fprintln(stdout, res.Machine.String())
	}
	type section struct {
		name string
		run  func() error
	}
	all := []section{
		{"stack", func() (err error) { res.Stack, err = runStack(ctx, o, stderr); return }},
		{"stores", func() (err error) { res.Stores, err = runStores(ctx, o, stderr); return }},
		{"txcost", func() (err error) { res.TxCost, err = runTxCost(ctx, o, stderr); return }},
		{"pgx", func() (err error) { res.Pgx, err = runPgx(ctx, o, stderr); return }},
		{"amqp", func() (err error) { res.AMQP, err = runAMQP(ctx, o, stderr); return }},
		{"batch", func() (err error) { res.Batch, err = runBatch(ctx, o, stderr); return }},
		{"brokers", func() (err error) { res.Brokers, err = runBrokers(ctx, o, stderr); return }},
		{"anchors", func() (err error) {
			res.Anchors, err = runAnchors(ctx, o, stderr)
			if at, ok := res.Runs["anchors"]; ok {
				at.Runs = anchorsRounds(o) // its own default rounds
				res.Runs["anchors"] = at
			}
			return
		}},
		{"outbox", func() (err error) { res.Outbox, err = runOutbox(ctx, o, stderr); return }},
		{"growth", func() (err error) { res.Growth, err = runGrowth(ctx, o, stderr); return }},
		{"attempts", func() (err error) { res.Attempts, err = runAttempts(ctx, o, stderr); return }},
		{"parked", func() (err error) { res.Parked, err = runParked(ctx, o, stderr); return }},
		{"nats", func() (err error) { res.NATS, err = runNATS(ctx, o, stderr); return }},
		{"redis", func() (err error) { res.Redis, err = runRedis(ctx, o, stderr); return }},
		{"scale", func() (err error) { res.Scale, err = runScale(ctx, o, res.Scale, stderr); return }},
	}
	for _, s := range all {
		if !o.only[s.name] {
			continue
		}
		start := time.Now()
		fmt.Fprintf(stderr, "== %s\n", s.name)
		res.Runs[s.name] = RunAt{Date: start.UTC().Format("2006-01-02 15:04 MST"), Quick: o.quick, Runs: o.runs, Load: loadAvg()}
		if err := s.run(); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		fmt.Fprintf(stderr, "== %s done in %s\n", s.name, time.Since(start).Round(time.Second))
		fmt.Fprintln(stdout, sectionTables(res, s.name))
	}
	if o.write == "" {
		return nil
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(o.results, append(b, '\n'), 0o644); err != nil {
		return err
	}
	doc, err := renderDoc(res)
	if err != nil {
		return err
	}
	return os.WriteFile(o.write, []byte(doc), 0o644)
}

// waitQuiet polls the load average every 30s, up to 10 minutes, until it is
// below max.
func waitQuiet(ctx context.Context, max float64, log io.Writer) {
	deadline := time.Now().Add(10 * time.Minute)
	for {
		l := loadAvg()
		if l <= max || time.Now().After(deadline) {
			fmt.Fprintf(log, "load average %.2f\n", l)
			return
		}
		fmt.Fprintf(log, "load average %.2f > %.2f, waiting\n", l, max)
		select {
		case <-ctx.Done():
			return
		case <-time.After(30 * time.Second):
		}
	}
}

// median of xs (xs is sorted in place).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
