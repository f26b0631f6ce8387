package integration_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/blackhole"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// The partition test's timing. The claim timeout is short so that the test
// is; everything else settle bounds is derived from it (StoreTimeout and
// CallTimeout: half of it).
const (
	partClaimTimeout = 2 * time.Second
	partKeys         = 24
	// partBound is how long after the partition starts every key must be
	// done: the partitioned consumer's calls end within a call timeout
	// (1s), the server ends its transactions after two (2s, PostgreSQL's
	// idle_in_transaction_session_timeout set by settle in OneStatement
	// and batch modes, MariaDB's idle_transaction_timeout from the DSN;
	// in PostgreSQL's default mode the cut comes in the handler, before
	// settle sets it, and the cut-off transaction holds no lock the other
	// consumer needs: its confirmation never arrived), its claims lapse
	// after a claim timeout, and the deliveries it deferred come back;
	// twice that again for a loaded machine.
	partBound = 2 * (2*partClaimTimeout + 2*time.Second)
	// partHeal is when a healed partition heals.
	partHeal = 5 * time.Second
	// partAfter keys are published after the heal.
	partAfter = 8
)

// partMySQLParams are the session settings docs/operating.md asks of a
// MariaDB DSN: no lock wait longer than a second, and the server ends a
// transaction whose client has been silent for two.
const partMySQLParams = "innodb_lock_wait_timeout=1&idle_transaction_timeout=2"

// A silent network partition between one consumer and its database: two
// consumers compete for one RabbitMQ queue, each with its own connections
// to the same database; consumer A's go through a proxy that, in the middle
// of one of A's transactions, stops forwarding bytes both ways without
// closing anything. Whether the partition heals within seconds or never,
// every key must be done exactly once (one effect row), and all within
// partBound of the cut: A's deliveries are deferred, not held, and B's
// statements do not wait for ever on locks held by A's transactions. On
// PostgreSQL and MariaDB, in the default mode (behind the dedupe
// middleware), OneStatement and group commit; on PostgreSQL through
// database/sql and through pgx.
func TestSilentPartitionOfOneConsumer(t *testing.T) {
	t.Parallel()
	for _, dbName := range []string{"postgres", "mysql", "pgx"} {
		for _, mode := range []string{"default", "one-statement", "batch"} {
			for _, heal := range []bool{true, false} {
				name := dbName + "/" + mode + "/never-healed"
				if heal {
					name = dbName + "/" + mode + "/healed"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					runPartition(t, dbName, mode, heal)
				})
			}
		}
	}
}

// partConsumer is one consumer: its database handle, subscriber and router.
type partConsumer struct {
	name   string
	db     *sql.DB
	router *message.Router
}

func runPartition(t *testing.T, dbName, mode string, heal bool) {
	amqpURL := testenv.AMQPURL(t)
	env, params := testenv.PostgresURLEnv, ""
	if dbName == "mysql" {
		env, params = testenv.MySQLURLEnv, partMySQLParams
	}
	dbURL := withParams(testenv.Require(t, env), params)
	direct := openURL(t, dbURL)
	dialect := direct.Dialect

	effects := testenv.Name(t, "fx")
	_, err := direct.ExecContext(t.Context(), "CREATE TABLE "+effects+" (msg VARCHAR(64) NOT NULL, consumer VARCHAR(8) NOT NULL)")
	saMust(t, err)
	t.Cleanup(func() { _, _ = direct.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+effects) })
	table := testenv.DedupeTable(t, direct)
	insert := "INSERT INTO " + effects + " (msg, consumer) VALUES (?, ?)"
	if dialect == sqldb.Postgres {
		insert = "INSERT INTO " + effects + " (msg, consumer) VALUES ($1, $2)"
	}

	// The proxy in front of consumer A's database.
	u, err := url.Parse(dbURL)
	saMust(t, err)
	proxy, err := blackhole.New(u.Host)
	saMust(t, err)
	u.Host = proxy.Addr()
	viaProxy, _, err := sqlurl.Open(u.String())
	saMust(t, err)
	t.Cleanup(func() { _ = viaProxy.Close() })
	t.Cleanup(func() { _ = proxy.Close() }) // before the handle closes: ends what the cut left blocked
	// A few connections, so that a stuck one does not stand for all of
	// them, as in a service's pool.
	viaProxy.SetMaxOpenConns(8)
	var pools [2]*pgxpool.Pool // A's and B's, with pgx
	if dbName == "pgx" {
		for i, u := range []string{u.String(), dbURL} {
			pc, err := pgxpool.ParseConfig(u)
			saMust(t, err)
			pc.MaxConns = 8
			pools[i], err = pgxpool.NewWithConfig(context.Background(), pc)
			saMust(t, err)
		}
		t.Cleanup(pools[0].Close)
		t.Cleanup(func() { _ = proxy.Close() })
		t.Cleanup(pools[1].Close)
	}

	src := testenv.Name(t, "src")
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	saMust(t, err)
	acfg := amqp.NewDurableQueueConfig(amqpURL)
	acfg.Marshaler = m
	acfg.Consume.Qos.PrefetchCount = 1
	acfg.Publish.ConfirmDelivery = true
	conn, err := amqp091.Dial(amqpURL)
	saMust(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	saMust(t, err)
	for _, q := range []string{src, src + ".poison", src + ".dead_letter"} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		saMust(t, err)
		t.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	}
	pub, err := amqp.NewPublisher(acfg, testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	var cut atomic.Bool
	var cutAt atomic.Int64 // unix nanoseconds
	var aRuns atomic.Int64
	startConsumer := func(name string, db *sql.DB, pool *pgxpool.Pool) *partConsumer {
		c := &partConsumer{name: name, db: db}
		sub, err := amqp.NewSubscriber(acfg, testenv.AMQPLogger(t, nil))
		saMust(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		var store dedupe.Store
		var sqlStore *dedupe.SQLStore[*sql.Tx]
		var pgxStore *dedupe.SQLStore[pgx.Tx]
		if pool != nil {
			pgxStore, err = dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: table})
			store = pgxStore
		} else {
			sqlStore, err = dedupe.NewSQLStore(sqldb.Std(db, dialect), dedupe.SQLConfig{Table: table})
			store = sqlStore
		}
		saMust(t, err)
		c.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
		saMust(t, err)
		p, err := pipeline.New(c.router, pipeline.Config{
			Publisher: pub, Store: store, Concurrency: 2, ClaimTimeout: partClaimTimeout,
			BusyDelay: 100 * time.Millisecond, UnavailableDelay: 100 * time.Millisecond, MaxUnavailableDelay: 500 * time.Millisecond,
			Retry: saFastRetry(20, 0), DisableTracing: true,
		})
		saMust(t, err)
		work := func() {
			if name == "a" && aRuns.Add(1) == 3 && cut.CompareAndSwap(false, true) {
				// In the middle of A's transaction: its effect row is
				// written, its key (or claim) locked, nothing committed.
				proxy.Cut()
				cutAt.Store(time.Now().UnixNano())
			}
			time.Sleep(20 * time.Millisecond) // the work of a real handler
		}
		batch := pipeline.BatchConfig{MaxSize: 2, MaxWait: 5 * time.Millisecond}
		if pool != nil {
			txc := pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(pool), Store: pgxStore, OneStatement: mode == "one-statement"}
			if mode == "batch" {
				txc.Batch = batch
			}
			_, err = pipeline.HandleTx(p, "charge", src, sub, txc, func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ message.Publisher) error {
				if _, err := tx.Exec(ctx, insert, msg.UUID, name); err != nil {
					return err
				}
				work()
				return nil
			})
		} else {
			txc := pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(db, dialect), Store: sqlStore, OneStatement: mode == "one-statement"}
			if mode == "batch" {
				txc.Batch = batch
			}
			_, err = pipeline.HandleTx(p, "charge", src, sub, txc, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
				if _, err := tx.ExecContext(ctx, insert, msg.UUID, name); err != nil {
					return err
				}
				work()
				return nil
			})
		}
		saMust(t, err)
		return c
	}
	a := startConsumer("a", viaProxy, pools[0])
	b := startConsumer("b", direct.DB, pools[1])
	stopA := runRouter(t, a.router, 30*time.Second)
	stopB := runRouter(t, b.router, 30*time.Second)
	t.Cleanup(stopA)
	t.Cleanup(stopB)

	publish := func(from, to int) {
		for i := from; i < to; i++ {
			saMust(t, pub.Publish(src, message.NewMessage(fmt.Sprintf("order-%d", i), []byte(`{}`))))
		}
	}
	// Keys until A has run its third handler (B may take the first ones),
	// then the rest.
	published := 0
	deadline := time.Now().Add(dedupeWait)
	for !cut.Load() {
		if published < partKeys/2 && time.Since(deadline.Add(-dedupeWait)) > time.Duration(published)*100*time.Millisecond {
			publish(published, published+2)
			published += 2
		}
		if time.Now().After(deadline) {
			t.Fatalf("consumer A ran %d handlers in %v; the partition never started", aRuns.Load(), dedupeWait)
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Unix(0, cutAt.Load())
	publish(published, partKeys)
	if heal {
		go func() {
			time.Sleep(time.Until(start.Add(partHeal)))
			proxy.Heal()
		}()
	}

	count := func() (rows, distinct int) {
		saMust(t, direct.QueryRowContext(t.Context(), "SELECT COUNT(*), COUNT(DISTINCT msg) FROM "+effects).Scan(&rows, &distinct))
		return rows, distinct
	}
	for {
		rows, distinct := count()
		if distinct == partKeys {
			t.Logf("every key done %v after the partition started (%d effect rows)", time.Since(start).Round(10*time.Millisecond), rows)
			break
		}
		if time.Since(start) > partBound {
			st, err := ch.QueueDeclarePassive(src, true, false, false, false, nil)
			saMust(t, err)
			t.Fatalf("%v after the partition started: %d of %d keys done (%d effect rows); queue holds %d ready, %d consumers",
				partBound, distinct, partKeys, rows, st.Messages, st.Consumers)
		}
		time.Sleep(50 * time.Millisecond)
	}

	if heal {
		// Past the heal, what A held back reaches the database, and A
		// consumes again: new keys are done once too, by either consumer.
		time.Sleep(time.Until(start.Add(partHeal + partClaimTimeout)))
		publish(partKeys, partKeys+partAfter)
		deadline := time.Now().Add(dedupeWait)
		for {
			if _, distinct := count(); distinct == partKeys+partAfter {
				break
			}
			if time.Now().After(deadline) {
				_, distinct := count()
				t.Fatalf("after the heal: %d of %d keys done in %v", distinct, partKeys+partAfter, dedupeWait)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// Nothing doubles later, whether A's link comes back or not: A's
	// transactions that were cut never commit a second effect.
	time.Sleep(partClaimTimeout)
	stopB()
	stopA()
	doubled := map[string]int{}
	rs, err := direct.QueryContext(t.Context(), "SELECT msg, COUNT(*) FROM "+effects+" GROUP BY msg HAVING COUNT(*) > 1")
	saMust(t, err)
	for rs.Next() {
		var msg string
		var n int
		saMust(t, rs.Scan(&msg, &n))
		doubled[msg] = n
	}
	saMust(t, rs.Err())
	if len(doubled) > 0 {
		t.Fatalf("keys done more than once: %v", doubled)
	}
	want := partKeys
	if heal {
		want += partAfter
	}
	if rows, distinct := count(); rows != want || distinct != want {
		t.Fatalf("%d effect rows (%d distinct) for %d keys; want each once", rows, distinct, want)
	}
	for _, q := range []string{src + ".poison", src + ".dead_letter"} {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		saMust(t, err)
		if st.Messages != 0 {
			t.Fatalf("%d messages parked on %s; a partition must defer, not park", st.Messages, q)
		}
	}
}

// withParams adds query parameters (a=1&b=2) to a URL.
func withParams(u, params string) string {
	if params == "" {
		return u
	}
	if strings.Contains(u, "?") {
		return u + "&" + params
	}
	return u + "?" + params
}

// openURL opens u (any of sqlurl's) and checks that it answers.
func openURL(t *testing.T, u string) testenv.DB {
	t.Helper()
	db, dialect, err := sqlurl.Open(u)
	saMust(t, err)
	t.Cleanup(func() { _ = db.Close() })
	saMust(t, db.PingContext(t.Context()))
	return testenv.DB{DB: db, Dialect: dialect}
}
