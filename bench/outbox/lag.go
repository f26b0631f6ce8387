package main

// The lag scenario: commit-to-delivery lag at a steady rate, with and
// without a transaction held open elsewhere on the server, and the idle
// load of each relay, for settle's relay, Watermill's bare forwarder and
// River's job pickup, in one run.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/settle-go/settle/internal/wirecount"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// counter counts the statements a relay sends twice: through pgx's tracer
// (n; the same count for database/sql over pgx's stdlib and for a pgx
// pool), and on the wire (w, a proxy its connections go through, which also
// sees what the tracer does not: the pools' health-check pings).
type counter struct {
	n   atomic.Int64
	w   *wirecount.Proxy
	url string // the database URL through w
}

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (c *counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) { c.n.Add(1) }
func (c *counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// arrivals records the first arrival of each sequence number.
type arrivals struct {
	mu    sync.Mutex
	at    []time.Time
	count int
	all   chan struct{}
}

func newArrivals(n int) *arrivals {
	return &arrivals{at: make([]time.Time, n), all: make(chan struct{})}
}

func (a *arrivals) arrive(i int) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if i < 0 || i >= len(a.at) || !a.at[i].IsZero() {
		return
	}
	a.at[i] = now
	a.count++
	if a.count == len(a.at) {
		close(a.all)
	}
}

// recorder is the broker of the outbox relays: it records when each
// message was handed to Publish.
type recorder struct{ a atomic.Pointer[arrivals] }

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	a := r.a.Load()
	for _, m := range msgs {
		if i, err := strconv.Atoi(m.Metadata.Get(seqKey)); err == nil && a != nil {
			a.arrive(i)
		}
	}
	return nil
}
func (r *recorder) Close() error { return nil }

// lagSubject is one way from a committed transaction to work started.
type lagSubject struct {
	name string
	// commit writes message i in a transaction of its own, on a connection
	// the counter does not see, and returns when COMMIT returned.
	commit func(ctx context.Context, i int) (time.Time, error)
	// start starts the relay (or River's client); its statements go
	// through ctr. Deliveries are recorded in rec.
	start func(ctx context.Context, ctr *counter, rec *recorder) (stop func() error, err error)
}

// lagRow is one subject's figures in one run.
type lagRow struct {
	p50, p99, bp50, bp99 time.Duration
	rate                 float64 // commits per second the producers reached
	idle                 float64 // statements per second, pgx's tracer
	idleWire             float64 // statements per second, on the wire
}

func (b *bench) runLag(ctx context.Context, stdout io.Writer) error {
	subjects, cleanup, err := b.lagSubjects(ctx)
	defer cleanup()
	if err != nil {
		return err
	}
	blockTable := b.topic("blocker")
	b.tables = append(b.tables, blockTable)
	if _, err := b.db.ExecContext(ctx, `CREATE TABLE "`+blockTable+`" (id BIGINT)`); err != nil {
		return err
	}
	rows := map[string][]lagRow{}
	for run := range b.o.runs {
		for _, s := range subjects {
			r, err := b.lagOnce(ctx, s, blockTable)
			if err != nil {
				return fmt.Errorf("lag %s: %w", s.name, err)
			}
			fmt.Fprintf(b.log, "run %d lag %s: %.0f commits/s, p50 %s p99 %s; with a blocker p50 %s p99 %s; idle %.2f statements/s (tracer), %.2f on the wire\n",
				run+1, s.name, r.rate, ms(r.p50), ms(r.p99), ms(r.bp50), ms(r.bp99), r.idle, r.idleWire)
			rows[s.name] = append(rows[s.name], r)
		}
	}
	fmt.Fprintf(stdout, "\nLag, one transaction per message at %d msgs/s for %s, %d producers; blocker: one write transaction held open 1 s every 5 s on another table; idle: statements/s of one relay over %s with nothing to do, counted by pgx's tracer and on the wire (a proxy reading the protocol's messages: Query, Execute, Close; pings included)%s; median of %d runs\n\n",
		b.o.rate, b.o.paced, b.o.producers, b.o.idle, wireNote(b.o.wire), b.o.runs)
	var t strings.Builder
	t.WriteString("| path | commits/s reached | p50 | p99 | p50 with blocker | p99 with blocker | idle statements/s (tracer) | idle statements/s (wire) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range subjects {
		rs := rows[s.name]
		med := func(f func(lagRow) float64) float64 {
			xs := make([]float64, len(rs))
			for i, r := range rs {
				xs[i] = f(r)
			}
			return median(xs)
		}
		d := func(f func(lagRow) time.Duration) string {
			return ms(time.Duration(med(func(r lagRow) float64 { return float64(f(r)) })))
		}
		fmt.Fprintf(&t, "| %s | %.0f | %s | %s | %s | %s | %.2f | %.2f |\n", s.name, med(func(r lagRow) float64 { return r.rate }),
			d(func(r lagRow) time.Duration { return r.p50 }), d(func(r lagRow) time.Duration { return r.p99 }),
			d(func(r lagRow) time.Duration { return r.bp50 }), d(func(r lagRow) time.Duration { return r.bp99 }),
			med(func(r lagRow) float64 { return r.idle }), med(func(r lagRow) float64 { return r.idleWire }))
	}
	fmt.Fprint(stdout, t.String())
	return nil
}

// lagOnce runs one subject: paced without and with a blocker, then idle.
func (b *bench) lagOnce(ctx context.Context, s lagSubject, blockTable string) (lagRow, error) {
	w, u, err := wirecount.Start(b.o.dbURL)
	if err != nil {
		return lagRow{}, err
	}
	defer w.Close()
	ctr := counter{w: w, url: u}
	if !b.o.wire {
		ctr.url = b.o.dbURL
	}
	rec := &recorder{}
	stop, err := s.start(ctx, &ctr, rec)
	if err != nil {
		return lagRow{}, err
	}
	var r lagRow
	err = func() error {
		time.Sleep(time.Second) // every client listening and polling
		var err error
		if r.p50, r.p99, r.rate, err = b.paced(ctx, s, rec, ""); err != nil {
			return err
		}
		if r.bp50, r.bp99, _, err = b.paced(ctx, s, rec, blockTable); err != nil {
			return err
		}
		// Idle: let the last wake-ups and retries pass, then count.
		time.Sleep(2 * time.Second)
		before, beforeWire := ctr.n.Load(), w.Statements()
		time.Sleep(b.o.idle)
		r.idle = float64(ctr.n.Load()-before) / b.o.idle.Seconds()
		r.idleWire = float64(w.Statements()-beforeWire) / b.o.idle.Seconds()
		return nil
	}()
	return r, errors.Join(err, stop())
}

// paced commits rate*paced messages at the rate and returns the lag
// percentiles and the commit rate the producers reached. With blockTable
// set, a transaction writes to it and stays open for 1 s every 5 s
// meanwhile.
func (b *bench) paced(ctx context.Context, s lagSubject, rec *recorder, blockTable string) (p50, p99 time.Duration, rate float64, err error) {
	n := int(float64(b.o.rate) * b.o.paced.Seconds())
	a := newArrivals(n)
	rec.a.Store(a)
	committed := make([]time.Time, n)
	bctx, stopBlocker := context.WithCancel(ctx)
	var wg sync.WaitGroup
	if blockTable != "" {
		wg.Go(func() { b.block(bctx, blockTable) })
	}
	start := time.Now()
	err = b.produce(ctx, n, start, time.Second/time.Duration(b.o.rate), func(i int) error {
		t, err := s.commit(ctx, i)
		committed[i] = t
		return err
	})
	stopBlocker()
	wg.Wait()
	if err != nil {
		return 0, 0, 0, err
	}
	rate = float64(n) / slices.MaxFunc(committed, func(x, y time.Time) int { return x.Compare(y) }).Sub(start).Seconds()
	select {
	case <-a.all:
	case <-time.After(30 * time.Second):
		return 0, 0, 0, fmt.Errorf("%d of %d messages arrived", a.count, n)
	case <-ctx.Done():
		return 0, 0, 0, ctx.Err()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	lags := make([]time.Duration, n)
	for i := range n {
		lags[i] = max(a.at[i].Sub(committed[i]), 0)
	}
	slices.Sort(lags)
	return percentile(lags, 0.50), percentile(lags, 0.99), rate, nil
}

// block holds a write transaction open for 1 s every 5 s, from 1 s on,
// until ctx ends.
func (b *bench) block(ctx context.Context, table string) {
	wait := time.Second
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = 4 * time.Second
		func() {
			tx, err := b.db.BeginTx(context.WithoutCancel(ctx), nil)
			if err != nil {
				return
			}
			defer func() { _ = tx.Rollback() }()
			if _, err := tx.Exec(`INSERT INTO "` + table + `" (id) VALUES (1)`); err != nil {
				return
			}
			time.Sleep(time.Second)
			_ = tx.Commit()
		}()
	}
}

// countedDB opens a database/sql handle over pgx's stdlib whose statements
// ctr counts.
func (b *bench) countedDB(ctr *counter) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(ctr.url)
	if err != nil {
		return nil, err
	}
	cfg.Tracer = ctr
	return stdlib.OpenDB(*cfg), nil
}

// countedPool opens a pgx pool whose statements ctr counts.
func (b *bench) countedPool(ctx context.Context, ctr *counter) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(ctr.url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Tracer = ctr
	return pgxpool.NewWithConfig(ctx, cfg)
}

func (b *bench) lagSubjects(ctx context.Context) ([]lagSubject, func(), error) {
	var cleanups []func()
	cleanup := func() {
		for _, c := range slices.Backward(cleanups) {
			c()
		}
	}
	var subjects []lagSubject

	// settle's relay, fallback poll 1 s, woken three ways: by the
	// pg_notify in the INSERT (the default), by a Notifier's NOTIFY after
	// the commit (Config.NotifyAfterCommit; the relay is built from an
	// Outbox of its own, as in another process, so that the writers'
	// Notify cannot wake it directly), and by Notify alone, the writers
	// being in the relay's process.
	for _, way := range []struct {
		name            string
		after, separate bool
	}{
		{"settle, NOTIFY in the INSERT (default)", false, true},
		{"settle, NOTIFY after commit (Notifier)", true, true},
		{"settle, writers in the relay's process (Notify)", true, false},
	} {
		cfg := outbox.Config{Topic: b.topic("lag_settle"), NotifyAfterCommit: way.after}
		writer, err := outbox.New(sqldb.Std(b.db, sqldb.Postgres), cfg)
		if err != nil {
			return nil, cleanup, err
		}
		b.tables = append(b.tables, writer.Table(), writer.Table()+"_relays")
		if err := writer.InitSchema(ctx); err != nil {
			return nil, cleanup, err
		}
		// The relay's outbox is on the counted pool start opens; without
		// separate, the writers' commits Notify it, as in its process.
		var relaying atomic.Pointer[outbox.Outbox[*sql.Tx]]
		subjects = append(subjects, lagSubject{
			name: way.name,
			commit: func(ctx context.Context, i int) (time.Time, error) {
				t, err := b.publishTx(ctx, path{inTx: b.sqlTx(writer.TxPublisher)}, "lag", i)
				if err == nil {
					writer.Notify()
					if r := relaying.Load(); r != nil && !way.separate {
						r.Notify()
					}
				}
				return t, err
			},
			start: func(ctx context.Context, ctr *counter, rec *recorder) (func() error, error) {
				var n *outbox.Notifier
				if way.after && way.separate {
					if n, err = writer.NewNotifier(); err != nil {
						return nil, err
					}
					go func() { _ = n.Run(context.WithoutCancel(ctx)) }()
				}
				db, err := b.countedDB(ctr)
				if err != nil {
					return nil, errors.Join(err, closeNotifier(n))
				}
				rob, err := outbox.New(sqldb.Std(db, sqldb.Postgres), cfg)
				if err != nil {
					return nil, errors.Join(err, db.Close(), closeNotifier(n))
				}
				relaying.Store(rob)
				r, err := rob.NewRelay(rec, outbox.RelayConfig{Logger: b.logger})
				if err != nil {
					return nil, errors.Join(err, db.Close(), closeNotifier(n))
				}
				return runUntilStopped(ctx, r.Run, r.Running(), func() error { return errors.Join(r.Close(), db.Close(), closeNotifier(n)) })
			},
		})
	}

	// The same on pgx: TxPublisher on the producers' pgx.Tx, the relay on
	// an outbox of a pool of its own whose statements ctr counts.
	ptopic := b.topic("lag_settle_pgx")
	pcfg := outbox.Config{Topic: ptopic}
	pob, err := outbox.New(sqldb.Pgx(b.pool), pcfg)
	if err != nil {
		return nil, cleanup, err
	}
	b.tables = append(b.tables, pob.Table(), pob.Table()+"_relays")
	if err := pob.InitSchema(ctx); err != nil {
		return nil, cleanup, err
	}
	subjects = append(subjects, lagSubject{
		name: "settle pgx, NOTIFY in the INSERT (default)",
		commit: func(ctx context.Context, i int) (time.Time, error) {
			return b.publishTx(ctx, path{inTx: pgxTx(b.pool, pob.TxPublisher)}, "lag", i)
		},
		start: func(ctx context.Context, ctr *counter, rec *recorder) (func() error, error) {
			pool, err := b.countedPool(ctx, ctr)
			if err != nil {
				return nil, err
			}
			rob, err := outbox.New(sqldb.Pgx(pool), pcfg)
			if err != nil {
				pool.Close()
				return nil, err
			}
			r, err := rob.NewRelay(rec, outbox.RelayConfig{Logger: b.logger})
			if err != nil {
				pool.Close()
				return nil, err
			}
			return runUntilStopped(ctx, r.Run, r.Running(), func() error {
				err := r.Close()
				pool.Close()
				return err
			})
		},
	})

	// Watermill's forwarder over watermill-sql, at its default poll and at
	// 10 ms.
	for _, poll := range []time.Duration{time.Second, 10 * time.Millisecond} {
		topic := b.topic("lag_bare")
		if err := b.initTables(ctx, topic); err != nil {
			return nil, cleanup, err
		}
		bare := b.barePath(topic)
		subjects = append(subjects, lagSubject{
			name: fmt.Sprintf("Watermill forwarder (poll %s)", poll),
			commit: func(ctx context.Context, i int) (time.Time, error) {
				return b.publishTx(ctx, bare, "lag", i)
			},
			start: func(ctx context.Context, ctr *counter, rec *recorder) (func() error, error) {
				db, err := b.countedDB(ctr)
				if err != nil {
					return nil, err
				}
				sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
					PollInterval:   poll,
					SchemaAdapter:  wsql.DefaultPostgreSQLSchema{},
					OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
				}, b.logger)
				if err != nil {
					return nil, errors.Join(err, db.Close())
				}
				f, err := forwarder.NewForwarder(sub, rec, b.logger, forwarder.Config{ForwarderTopic: topic})
				if err != nil {
					return nil, errors.Join(err, sub.Close(), db.Close())
				}
				return runUntilStopped(ctx, f.Run, f.Running(), func() error { return errors.Join(f.Close(), sub.Close(), db.Close()) })
			},
		})
	}

	// River: insert in the transaction, work started by a worker.
	rs, rcleanup, err := b.riverSubject(ctx)
	cleanups = append(cleanups, rcleanup)
	if err != nil {
		return nil, cleanup, err
	}
	subjects = append(subjects, rs)
	if b.o.lagPaths != "" {
		subjects = slices.DeleteFunc(subjects, func(s lagSubject) bool { return !strings.Contains(s.name, b.o.lagPaths) })
	}
	return subjects, cleanup, nil
}

// wireNote says where the lag was measured from: with -wire, every path's
// connections go through the counting proxy, one more local hop each way.
func wireNote(on bool) string {
	if on {
		return "; the relays' connections go through that proxy during the lag runs too"
	}
	return "; -wire=false: the wire column counts nothing"
}

func closeNotifier(n *outbox.Notifier) error {
	if n == nil {
		return nil
	}
	return n.Close()
}

type lagArgs struct {
	Seq int `json:"seq"`
}

func (lagArgs) Kind() string { return "settle_bench_lag" }

type lagWorker struct {
	river.WorkerDefaults[lagArgs]
	rec *recorder
}

func (w *lagWorker) Work(_ context.Context, job *river.Job[lagArgs]) error {
	if a := w.rec.a.Load(); a != nil {
		a.arrive(job.Args.Seq)
	}
	return nil
}

// riverSubject is River v0.51.2 in a schema of its own: LISTEN/NOTIFY
// pickup with FetchCooldown 10 ms (its default, 100 ms, caps a queue at a
// few hundred jobs/s) and 100 workers.
func (b *bench) riverSubject(ctx context.Context) (lagSubject, func(), error) {
	schema := b.topic("river")
	drop := func() {
		_, _ = b.db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`)
	}
	if _, err := b.db.ExecContext(ctx, `CREATE SCHEMA "`+schema+`"`); err != nil {
		return lagSubject{}, drop, err
	}
	producers, err := pgxpool.New(ctx, b.o.dbURL)
	if err != nil {
		return lagSubject{}, drop, err
	}
	cleanup := func() { producers.Close(); drop() }
	quiet := slog.New(slog.DiscardHandler)
	mig, err := rivermigrate.New(riverpgxv5.New(producers), &rivermigrate.Config{Schema: schema, Logger: quiet})
	if err != nil {
		return lagSubject{}, cleanup, err
	}
	if _, err := mig.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return lagSubject{}, cleanup, fmt.Errorf("river migrate: %w", err)
	}
	// An insert-only client for the producers. Its FetchCooldown also
	// spaces its insert notifications: at the 100 ms default, a job waits
	// 50 ms on average for the notification that wakes the workers.
	inserter, err := river.NewClient(riverpgxv5.New(producers), &river.Config{Schema: schema, Logger: quiet, FetchCooldown: 10 * time.Millisecond})
	if err != nil {
		return lagSubject{}, cleanup, err
	}
	return lagSubject{
		name: "River (LISTEN/NOTIFY, FetchCooldown 10ms)",
		commit: func(ctx context.Context, i int) (time.Time, error) {
			tx, err := producers.Begin(ctx)
			if err != nil {
				return time.Time{}, err
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			if _, err := inserter.InsertTx(ctx, tx, lagArgs{Seq: i}, nil); err != nil {
				return time.Time{}, err
			}
			if err := tx.Commit(ctx); err != nil {
				return time.Time{}, err
			}
			return time.Now(), nil
		},
		start: func(ctx context.Context, ctr *counter, rec *recorder) (func() error, error) {
			pcfg, err := pgxpool.ParseConfig(ctr.url)
			if err != nil {
				return nil, err
			}
			pcfg.ConnConfig.Tracer = ctr
			pool, err := pgxpool.NewWithConfig(ctx, pcfg)
			if err != nil {
				return nil, err
			}
			workers := river.NewWorkers()
			river.AddWorker(workers, &lagWorker{rec: rec})
			client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
				Schema:        schema,
				Logger:        quiet,
				FetchCooldown: 10 * time.Millisecond,
				Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 100}},
				Workers:       workers,
			})
			if err == nil {
				err = client.Start(ctx)
			}
			if err != nil {
				pool.Close()
				return nil, err
			}
			return func() error {
				sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				err := client.Stop(sctx)
				pool.Close()
				return err
			}, nil
		},
	}, cleanup, nil
}
