// Command outbox measures settle's transactional outbox beside a direct
// publish and beside Watermill's bare forwarder over watermill-sql, in one
// run, on a real PostgreSQL and a real broker (GoChannel or RabbitMQ).
//
// From the harness's directory (bench, a module of its own):
//
//	go run ./outbox                        # GoChannel, local PostgreSQL
//	go run ./outbox -broker gochannel,amqp # both brokers
//	go run ./outbox -n 20000 -poll 20ms -rate 1000 -runs 3
//
// Scenarios, each on its own outbox tables and broker topic (dropped at the
// end):
//
//   - direct: N messages published straight to the broker, no database.
//   - forward: N transactions of one message each, written by -producers
//     goroutines while the forwarder runs; the time runs from the first
//     BEGIN to the arrival of the last message at a subscriber of the
//     broker. "bare" is watermill-sql's publisher on wsql.TxFromStdSQL(tx)
//     wrapped by forwarder.NewPublisher, forwarded by forwarder.NewForwarder
//     on a watermill-sql subscriber; "settle" is Outbox.TxPublisher(tx) and
//     Outbox.NewRelay on database/sql (sqldb.Std); "settle pgx" is the same
//     on a pgx.Tx and a pgxpool.Pool (sqldb.Pgx). All poll with
//     -poll and read 100 rows per query (the watermill-sql PostgreSQL
//     default).
//   - paced: the same at a fixed -rate for -paced, to read the lag of an
//     outbox that keeps up.
//   - prefilled: N rows committed first, then the forwarder started: the
//     forwarding speed alone.
//
// Lag is the time from the return of a message's COMMIT to its arrival at the
// broker's subscriber. Each message carries its sequence number in metadata;
// the commit and arrival times are recorded in memory against it.
//
// The table printed on stdout holds the median of -runs runs of every cell.
package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

const seqKey = "bench_seq"

type options struct {
	dbURL      string
	amqpURL    string
	brokers    []string
	scenarios  map[string]bool
	n          int
	rate       int
	paced      time.Duration
	poll       time.Duration
	producers  int
	payload    int
	runs       int
	confirm    bool
	amqpPool   int
	timeout    time.Duration
	cpuprofile string
	verbose    bool
	idle       time.Duration
	wire       bool
	lagPaths   string
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox bench:", err)
		os.Exit(2)
	}
	if err := run(o, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "outbox bench:", err)
		os.Exit(1)
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("outbox", flag.ContinueOnError)
	fs.StringVar(&o.dbURL, "db", envOr("SETTLE_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default: $SETTLE_POSTGRES_URL or the local server)")
	fs.StringVar(&o.amqpURL, "amqp", envOr("SETTLE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL used by -broker amqp (default: $SETTLE_AMQP_URL or the local server)")
	broker := fs.String("broker", "gochannel", "comma-separated brokers: gochannel, amqp, or an amqp:// URL")
	scen := fs.String("scenarios", "direct,forward,paced,prefilled", "comma-separated scenarios to run")
	fs.IntVar(&o.n, "n", 5000, "messages per direct, forward and prefilled scenario")
	fs.IntVar(&o.rate, "rate", 1000, "messages per second of the paced scenario")
	fs.DurationVar(&o.paced, "paced", 5*time.Second, "duration of the paced scenario")
	fs.DurationVar(&o.poll, "poll", 10*time.Millisecond, "PollInterval of both forwarders")
	fs.IntVar(&o.producers, "producers", 4, "goroutines publishing (one transaction per message)")
	fs.IntVar(&o.payload, "payload", 100, "payload bytes per message")
	fs.IntVar(&o.runs, "runs", 3, "runs; the table shows the median of each cell")
	fs.BoolVar(&o.confirm, "confirm", true, "RabbitMQ: wait for publisher confirms (Publish.ConfirmDelivery); settle's relay refuses a publisher without them, so only true is accepted")
	fs.IntVar(&o.amqpPool, "amqp-pool", 0, "RabbitMQ: Publish.ChannelPoolSize (0, the config's default, opens and closes a channel per Publish)")
	fs.DurationVar(&o.timeout, "timeout", 20*time.Minute, "bound on the whole run")
	fs.DurationVar(&o.idle, "idle", 10*time.Second, "lag scenario: how long each relay's idle statements are counted")
	fs.BoolVar(&o.wire, "wire", true, "lag scenario: run each path's connections through a proxy that counts their statements on the wire")
	fs.StringVar(&o.lagPaths, "lag-paths", "", "lag scenario: run only the paths whose name contains this text")
	fs.BoolVar(&o.verbose, "v", false, "log the forwarders' errors and infos to stderr")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the whole run to this file")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	for b := range strings.SplitSeq(*broker, ",") {
		switch b = strings.TrimSpace(b); {
		case b == "gochannel":
		case b == "amqp":
			b = o.amqpURL
		case strings.HasPrefix(b, "amqp://") || strings.HasPrefix(b, "amqps://"):
		default:
			return o, fmt.Errorf("-broker: unknown broker %q", b)
		}
		o.brokers = append(o.brokers, b)
	}
	o.scenarios = map[string]bool{}
	for s := range strings.SplitSeq(*scen, ",") {
		switch s = strings.TrimSpace(s); s {
		case "direct", "forward", "paced", "prefilled", "lag":
			o.scenarios[s] = true
		default:
			return o, fmt.Errorf("-scenarios: unknown scenario %q", s)
		}
	}
	switch {
	case o.n <= 0:
		return o, errors.New("-n must be > 0")
	case o.rate <= 0 || o.paced <= 0:
		return o, errors.New("-rate and -paced must be > 0")
	case o.poll <= 0:
		return o, errors.New("-poll must be > 0")
	case o.producers <= 0 || o.runs <= 0:
		return o, errors.New("-producers and -runs must be > 0")
	case o.amqpPool < 0:
		return o, errors.New("-amqp-pool must be >= 0")
	case !o.confirm:
		return o, errors.New("-confirm=false: settle's relay refuses a watermill-amqp publisher without Publish.ConfirmDelivery (outbox.ErrUnconfirmedPublisher)")
	}
	return o, nil
}

// result is one scenario of one run.
type result struct {
	rate     float64       // messages per second, end to end
	p50, p99 time.Duration // commit-to-arrival lag; 0 when not measured
	hasLag   bool
}

// key names a table row.
type key struct{ broker, scenario, path string }

func run(o options, stdout, stderr io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()

	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	db, dialect, err := sqlurl.Open(o.dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	// database/sql keeps 2 idle connections by default: more producers
	// than that would open a connection per transaction.
	db.SetMaxIdleConns(16)
	if dialect != sqldb.Postgres {
		return fmt.Errorf("-db: PostgreSQL only, got %s", dialect)
	}
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("-db: %w", err)
	}
	var pgVersion string
	_ = db.QueryRowContext(ctx, "SHOW server_version").Scan(&pgVersion)
	// The pgx paths' pool: the producers, the relay's batches and its LISTEN
	// connection (database/sql's pool has no bound).
	pcfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return fmt.Errorf("-db: %w", err)
	}
	pcfg.MaxConns = int32(o.producers + 4)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("-db: %w", err)
	}
	defer pool.Close()

	b := &bench{o: o, db: db, pool: pool, log: stderr, id: randomID(), logger: watermill.NopLogger{}}
	if o.verbose {
		b.logger = watermill.NewStdLoggerWithOut(stderr, false, false)
	}
	defer b.cleanup()

	results := map[key][]result{}
	var order []key
	add := func(k key, r result) {
		if _, ok := results[k]; !ok {
			order = append(order, k)
		}
		results[k] = append(results[k], r)
	}

	onlyLag := len(o.scenarios) == 1 && o.scenarios["lag"]
	for i := range o.runs {
		if onlyLag {
			break
		}
		for _, brokerURL := range o.brokers {
			br, err := b.openBroker(ctx, brokerURL)
			if err != nil {
				return err
			}
			err = b.runOnce(ctx, i, br, add)
			if cerr := br.close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		}
	}

	fmt.Fprintf(stdout, "PostgreSQL %s, %d CPUs, GOMAXPROCS %d, %s; n=%d, producers=%d, poll=%s, paced %d msgs/s for %s, payload %d B, median of %d runs\n\n",
		pgVersion, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), o.n, o.producers, o.poll, o.rate, o.paced, o.payload, o.runs)
	if !onlyLag {
		fmt.Fprint(stdout, format(order, results))
	}
	if o.scenarios["lag"] {
		return b.runLag(ctx, stdout)
	}
	return nil
}

// format prints one row per broker, scenario and path, with the ratio of
// settle's msgs/s to the bare forwarder's.
func format(order []key, results map[key][]result) string {
	var sb strings.Builder
	sb.WriteString("| broker | scenario | path | msgs/s | lag p50 | lag p99 | settle/bare msgs/s |\n")
	sb.WriteString("|---|---|---|---:|---:|---:|---:|\n")
	med := func(k key) (rate float64, p50, p99 time.Duration, hasLag bool) {
		rs := results[k]
		var rates, a, c []float64
		for _, r := range rs {
			rates = append(rates, r.rate)
			a = append(a, float64(r.p50))
			c = append(c, float64(r.p99))
			hasLag = r.hasLag
		}
		return median(rates), time.Duration(median(a)), time.Duration(median(c)), hasLag
	}
	for _, k := range order {
		rate, p50, p99, hasLag := med(k)
		l50, l99, ratio := "–", "–", "–"
		if hasLag {
			l50, l99 = ms(p50), ms(p99)
		}
		if strings.HasPrefix(k.path, "settle") && !strings.HasPrefix(k.scenario, "paced") {
			if bare, ok := results[key{k.broker, k.scenario, "bare"}]; ok && len(bare) > 0 {
				br, _, _, _ := med(key{k.broker, k.scenario, "bare"})
				ratio = strconv.FormatFloat(rate/br, 'f', 2, 64)
			}
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %.0f | %s | %s | %s |\n", k.broker, k.scenario, k.path, rate, l50, l99, ratio)
	}
	return sb.String()
}

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64) + " ms"
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// percentile returns the nearest-rank p-th percentile (0 < p <= 1).
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := max(int(math.Ceil(p*float64(len(sorted))))-1, 0)
	return sorted[i]
}

func randomID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// bench holds what one invocation creates, to drop it at the end.
type bench struct {
	o      options
	db     *sql.DB
	pool   *pgxpool.Pool // the pgx paths'
	log    io.Writer
	logger watermill.LoggerAdapter // the forwarders'
	id     string
	seq    int

	tables []string
	queues map[string][]string // amqp URL -> queues
}

// topic returns a fresh name for tag: unique per run and scenario.
func (b *bench) topic(tag string) string {
	b.seq++
	return fmt.Sprintf("sob_%s_%d_%s", b.id, b.seq, tag)
}

func (b *bench) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, t := range b.tables {
		if _, err := b.db.ExecContext(ctx, `DROP TABLE IF EXISTS "`+t+`"`); err != nil {
			fmt.Fprintf(b.log, "drop table %s: %v\n", t, err)
		}
	}
	for url, qs := range b.queues {
		conn, err := amqp091.Dial(url)
		if err != nil {
			fmt.Fprintf(b.log, "delete queues: %v\n", err)
			continue
		}
		ch, err := conn.Channel()
		if err == nil {
			for _, q := range qs {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					fmt.Fprintf(b.log, "delete queue %s: %v\n", q, err)
					break // the channel is closed after an error
				}
			}
			_ = ch.Close()
		}
		_ = conn.Close()
	}
}

// initTables creates the watermill-sql tables of an outbox topic with
// watermill-sql's own PostgreSQL adapters, in a transaction of their own.
func (b *bench) initTables(ctx context.Context, topic string) error {
	b.tables = append(b.tables, "watermill_"+topic, "watermill_offsets_"+topic)
	qs, err := wsql.DefaultPostgreSQLSchema{}.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: topic})
	if err != nil {
		return err
	}
	oqs, err := wsql.DefaultPostgreSQLOffsetsAdapter{}.SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: topic})
	if err != nil {
		return err
	}
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	for _, q := range append(qs, oqs...) {
		if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return fmt.Errorf("init %s: %w", topic, err)
		}
	}
	return tx.Commit()
}

// broker is the destination: a publisher for the forwarders and the direct
// path, and a way to watch a topic.
type broker struct {
	name  string
	url   string // "gochannel" or the amqp URL
	pub   message.Publisher
	sub   message.Subscriber
	close func() error
}

func (b *bench) openBroker(_ context.Context, url string) (*broker, error) {
	if url == "gochannel" {
		gc := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		return &broker{name: "gochannel", url: url, pub: gc, sub: gc, close: gc.Close}, nil
	}
	pcfg := amqp.NewDurableQueueConfig(url)
	pcfg.Publish.ConfirmDelivery = b.o.confirm
	pcfg.Publish.ChannelPoolSize = b.o.amqpPool
	pub, err := amqp.NewPublisher(pcfg, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("amqp publisher: %w", err)
	}
	scfg := amqp.NewDurableQueueConfig(url)
	// The subscriber only measures arrival: a deep prefetch keeps it from
	// being the bottleneck.
	scfg.Consume.Qos.PrefetchCount = 200
	sub, err := amqp.NewSubscriber(scfg, watermill.NopLogger{})
	if err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("amqp subscriber: %w", err)
	}
	var extra []string
	if b.o.amqpPool > 0 {
		extra = append(extra, fmt.Sprintf("%d pooled channels", b.o.amqpPool))
	}
	name := "rabbitmq"
	if len(extra) > 0 {
		name += " (" + strings.Join(extra, ", ") + ")"
	}
	if b.queues == nil {
		b.queues = map[string][]string{}
	}
	return &broker{name: name, url: url, pub: pub, sub: sub, close: func() error {
		return errors.Join(sub.Close(), pub.Close())
	}}, nil
}

// watch subscribes to topic and records when each sequence number arrives.
type watch struct {
	n       int
	arrived []time.Time
	count   int
	dups    int
	done    chan struct{}
	stopped chan struct{}
	cancel  context.CancelFunc
}

func (b *bench) watch(ctx context.Context, br *broker, url, topic string, n int) (*watch, error) {
	ctx, cancel := context.WithCancel(ctx)
	ch, err := br.sub.Subscribe(ctx, topic)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("subscribe %s: %w", topic, err)
	}
	if url != "gochannel" {
		b.queues[url] = append(b.queues[url], topic)
	}
	w := &watch{n: n, arrived: make([]time.Time, n), done: make(chan struct{}), stopped: make(chan struct{}), cancel: cancel}
	go func() {
		defer close(w.stopped)
		for msg := range ch {
			now := time.Now()
			msg.Ack()
			i, err := strconv.Atoi(msg.Metadata.Get(seqKey))
			if err != nil || i < 0 || i >= n {
				continue
			}
			if !w.arrived[i].IsZero() {
				w.dups++
				continue
			}
			w.arrived[i] = now
			w.count++
			if w.count == n {
				close(w.done)
			}
		}
	}()
	return w, nil
}

// wait returns when every message arrived, or fails after limit.
func (w *watch) wait(ctx context.Context, limit time.Duration) error {
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case <-w.done:
		return nil
	case <-t.C:
	case <-ctx.Done():
	}
	w.stop()
	return fmt.Errorf("%d of %d messages arrived within %s", w.count, w.n, limit)
}

// duplicates returns how many messages arrived more than once.
func (w *watch) duplicates() int { return w.dups }

// stop ends the subscription; the arrival times may be read afterwards.
func (w *watch) stop() {
	w.cancel()
	<-w.stopped
}

func (b *bench) newMessage(i int) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), make([]byte, b.o.payload))
	m.Metadata.Set(seqKey, strconv.Itoa(i))
	return m
}

// path is one way from a transaction to the broker: bare Watermill or
// settle's outbox, on database/sql or on pgx.
type path struct {
	name string
	// inTx runs fn in a transaction of its own with a publisher bound to it,
	// and commits it.
	inTx func(ctx context.Context, fn func(pub message.Publisher) error) error
	// start runs the forwarder into out; stop stops it.
	start func(ctx context.Context, out message.Publisher) (stop func() error, err error)
}

// sqlTx is path.inTx on database/sql, with the publisher bind makes.
func (b *bench) sqlTx(bind func(tx *sql.Tx) (message.Publisher, error)) func(context.Context, func(message.Publisher) error) error {
	return func(ctx context.Context, fn func(message.Publisher) error) error {
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := bind(tx)
		if err != nil {
			return err
		}
		if err := fn(pub); err != nil {
			return err
		}
		return tx.Commit()
	}
}

// pgxTx is path.inTx on a pgx pool, with the publisher bind makes.
func pgxTx(pool *pgxpool.Pool, bind func(tx pgx.Tx) (message.Publisher, error)) func(context.Context, func(message.Publisher) error) error {
	return func(ctx context.Context, fn func(message.Publisher) error) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		pub, err := bind(tx)
		if err != nil {
			return err
		}
		if err := fn(pub); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
}

func (b *bench) barePath(topic string) path {
	return path{
		name: "bare",
		inTx: b.sqlTx(func(tx *sql.Tx) (message.Publisher, error) {
			p, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, watermill.NopLogger{})
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(p, forwarder.PublisherConfig{ForwarderTopic: topic}), nil
		}),
		start: func(ctx context.Context, out message.Publisher) (func() error, error) {
			sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(b.db), wsql.SubscriberConfig{
				PollInterval:   b.o.poll,
				SchemaAdapter:  wsql.DefaultPostgreSQLSchema{},
				OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
			}, b.logger)
			if err != nil {
				return nil, err
			}
			f, err := forwarder.NewForwarder(sub, out, b.logger, forwarder.Config{ForwarderTopic: topic})
			if err != nil {
				return nil, errors.Join(err, sub.Close())
			}
			return runUntilStopped(ctx, f.Run, f.Running(), func() error { return errors.Join(f.Close(), sub.Close()) })
		},
	}
}

func (b *bench) settlePath(ctx context.Context, topic string) (path, error) {
	ob, err := outbox.New(sqldb.Std(b.db, sqldb.Postgres), outbox.Config{Topic: topic})
	if err != nil {
		return path{}, err
	}
	b.tables = append(b.tables, ob.Table(), ob.Table()+"_relays")
	if err := ob.InitSchema(ctx); err != nil {
		return path{}, err
	}
	return path{
		name: "settle",
		inTx: b.sqlTx(ob.TxPublisher),
		start: func(ctx context.Context, out message.Publisher) (func() error, error) {
			r, err := ob.NewRelay(out, outbox.RelayConfig{PollInterval: b.o.poll, Logger: b.logger})
			if err != nil {
				return nil, err
			}
			return b.runRelay(ctx, r)
		},
	}, nil
}

// settlePgxPath is settle's outbox on pgx: TxPublisher on the producers'
// pgx.Tx, the relay on the pool.
func (b *bench) settlePgxPath(ctx context.Context, topic string) (path, error) {
	ob, err := outbox.New(sqldb.Pgx(b.pool), outbox.Config{Topic: topic})
	if err != nil {
		return path{}, err
	}
	b.tables = append(b.tables, ob.Table(), ob.Table()+"_relays")
	if err := ob.InitSchema(ctx); err != nil {
		return path{}, err
	}
	return path{
		name: "settle pgx",
		inTx: pgxTx(b.pool, ob.TxPublisher),
		start: func(ctx context.Context, out message.Publisher) (func() error, error) {
			r, err := ob.NewRelay(out, outbox.RelayConfig{PollInterval: b.o.poll, Logger: b.logger})
			if err != nil {
				return nil, err
			}
			return b.runRelay(ctx, r)
		},
	}, nil
}

// runRelay runs r until the stop it returns, which reports retried
// forwards.
func (b *bench) runRelay(ctx context.Context, r *outbox.Relay) (func() error, error) {
	return runUntilStopped(ctx, r.Run, r.Running(), func() error {
		if fwd, failed := r.Counts(); failed > 0 {
			fmt.Fprintf(b.log, "settle relay: %d forwarded, %d forwards failed and were retried\n", fwd, failed)
		}
		return r.Close()
	})
}

// runUntilStopped runs run in a goroutine until it is running, and returns
// a stop that closes it and waits for run to return.
func runUntilStopped(ctx context.Context, run func(context.Context) error, running chan struct{}, closeFn func() error) (func() error, error) {
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	select {
	case <-running:
	case err := <-done:
		return nil, errors.Join(fmt.Errorf("forwarder stopped before running: %w", err), closeFn())
	}
	return func() error {
		cerr := closeFn()
		return errors.Join(cerr, <-done)
	}, nil
}

// publishTx writes message i in a transaction of its own and returns the
// time COMMIT returned.
func (b *bench) publishTx(ctx context.Context, p path, dest string, i int) (time.Time, error) {
	if err := p.inTx(ctx, func(pub message.Publisher) error { return pub.Publish(dest, b.newMessage(i)) }); err != nil {
		return time.Time{}, err
	}
	return time.Now(), nil
}

// produce calls fn(i) for i in [0, n) from -producers goroutines; with
// interval > 0, message i is not sent before start + i*interval.
func (b *bench) produce(ctx context.Context, n int, start time.Time, interval time.Duration, fn func(i int) error) error {
	var wg sync.WaitGroup
	errs := make([]error, b.o.producers)
	for g := range b.o.producers {
		wg.Go(func() {
			for i := g; i < n; i += b.o.producers {
				if interval > 0 {
					if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
						select {
						case <-time.After(d):
						case <-ctx.Done():
							errs[g] = ctx.Err()
							return
						}
					}
				}
				if err := fn(i); err != nil {
					errs[g] = fmt.Errorf("message %d: %w", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (b *bench) limit(n int) time.Duration {
	return 30*time.Second + time.Duration(n)*5*time.Millisecond
}

func lagResult(n int, start time.Time, committed, arrived []time.Time) result {
	last := start
	lags := make([]time.Duration, 0, n)
	for i := range n {
		if arrived[i].After(last) {
			last = arrived[i]
		}
		if !committed[i].IsZero() {
			lags = append(lags, max(arrived[i].Sub(committed[i]), 0))
		}
	}
	slices.Sort(lags)
	r := result{rate: float64(n) / last.Sub(start).Seconds()}
	if len(lags) > 0 {
		r.p50, r.p99, r.hasLag = percentile(lags, 0.50), percentile(lags, 0.99), true
	}
	return r
}

func (b *bench) runOnce(ctx context.Context, run int, br *broker, add func(key, result)) error {
	url := br.url
	report := func(scenario, pathName string, r result) {
		add(key{br.name, scenario, pathName}, r)
		lag := ""
		if r.hasLag {
			lag = fmt.Sprintf(", lag p50 %s p99 %s", ms(r.p50), ms(r.p99))
		}
		fmt.Fprintf(b.log, "run %d %s %s %s: %.0f msgs/s%s\n", run+1, br.name, scenario, pathName, r.rate, lag)
	}

	if b.o.scenarios["direct"] {
		dest := b.topic("direct")
		w, err := b.watch(ctx, br, url, dest, b.o.n)
		if err != nil {
			return err
		}
		start := time.Now()
		err = b.produce(ctx, b.o.n, start, 0, func(i int) error { return br.pub.Publish(dest, b.newMessage(i)) })
		if err == nil {
			err = w.wait(ctx, b.limit(b.o.n))
		}
		w.stop()
		if err != nil {
			return fmt.Errorf("%s direct: %w", br.name, err)
		}
		report("direct", "broker only", lagResult(b.o.n, start, make([]time.Time, b.o.n), w.arrived))
	}

	paths := func(tag string) ([]path, error) {
		bare := b.topic(tag + "b")
		if err := b.initTables(ctx, bare); err != nil {
			return nil, err
		}
		sp, err := b.settlePath(ctx, b.topic(tag+"s"))
		if err != nil {
			return nil, err
		}
		pp, err := b.settlePgxPath(ctx, b.topic(tag+"p"))
		if err != nil {
			return nil, err
		}
		ps := []path{b.barePath(bare), sp, pp}
		// Rotate which goes first from run to run.
		return append(ps[run%len(ps):], ps[:run%len(ps)]...), nil
	}

	// forward and paced: transactions while the forwarder runs.
	live := func(scenario string, n int, interval time.Duration) error {
		ps, err := paths(scenario[:1])
		if err != nil {
			return err
		}
		for _, p := range ps {
			dest := b.topic("dest")
			w, err := b.watch(ctx, br, url, dest, n)
			if err != nil {
				return err
			}
			stop, err := p.start(ctx, br.pub)
			if err != nil {
				w.stop()
				return fmt.Errorf("%s %s %s: %w", br.name, scenario, p.name, err)
			}
			committed := make([]time.Time, n)
			start := time.Now()
			err = b.produce(ctx, n, start, interval, func(i int) error {
				t, err := b.publishTx(ctx, p, dest, i)
				committed[i] = t
				return err
			})
			if err == nil {
				err = w.wait(ctx, b.limit(n))
			}
			w.stop()
			err = errors.Join(err, stop())
			if err != nil {
				return fmt.Errorf("%s %s %s: %w", br.name, scenario, p.name, err)
			}
			if d := w.duplicates(); d > 0 {
				fmt.Fprintf(b.log, "%s %s: %d messages arrived twice\n", br.name, p.name, d)
			}
			report(scenario, p.name, lagResult(n, start, committed, w.arrived))
		}
		return nil
	}
	if b.o.scenarios["forward"] {
		if err := live("forward", b.o.n, 0); err != nil {
			return err
		}
	}
	if b.o.scenarios["paced"] {
		n := int(float64(b.o.rate) * b.o.paced.Seconds())
		if err := live(fmt.Sprintf("paced %d/s", b.o.rate), n, time.Second/time.Duration(b.o.rate)); err != nil {
			return err
		}
	}

	if b.o.scenarios["prefilled"] {
		ps, err := paths("f")
		if err != nil {
			return err
		}
		for _, p := range ps {
			dest := b.topic("dest")
			if err := b.fill(ctx, p, dest, b.o.n); err != nil {
				return fmt.Errorf("%s prefilled %s: fill: %w", br.name, p.name, err)
			}
			w, err := b.watch(ctx, br, url, dest, b.o.n)
			if err != nil {
				return err
			}
			start := time.Now()
			stop, err := p.start(ctx, br.pub)
			if err == nil {
				err = w.wait(ctx, b.limit(b.o.n))
				w.stop()
				err = errors.Join(err, stop())
			} else {
				w.stop()
			}
			if err != nil {
				return fmt.Errorf("%s prefilled %s: %w", br.name, p.name, err)
			}
			if d := w.duplicates(); d > 0 {
				fmt.Fprintf(b.log, "%s %s: %d messages arrived twice\n", br.name, p.name, d)
			}
			report("prefilled", p.name, lagResult(b.o.n, start, make([]time.Time, b.o.n), w.arrived))
		}
	}
	return nil
}

// fill commits n messages into p's outbox, 100 per transaction.
func (b *bench) fill(ctx context.Context, p path, dest string, n int) error {
	const batch = 100
	for lo := 0; lo < n; lo += batch {
		msgs := make([]*message.Message, 0, batch)
		for i := lo; i < min(lo+batch, n); i++ {
			msgs = append(msgs, b.newMessage(i))
		}
		if err := p.inTx(ctx, func(pub message.Publisher) error { return pub.Publish(dest, msgs...) }); err != nil {
			return err
		}
	}
	return nil
}
