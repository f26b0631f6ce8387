package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/blackhole"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// partitionedDB opens env's database through a proxy, on one connection:
// a connection left in an unknown state would be the next transaction's.
func partitionedDB(t *testing.T, env string) (*blackhole.Proxy, string) {
	t.Helper()
	u, err := url.Parse(testenv.Require(t, env))
	must(t, err)
	p, err := blackhole.New(u.Host)
	must(t, err)
	t.Cleanup(func() { _ = p.Close() })
	u.Host = p.Addr()
	return p, u.String()
}

// A transaction whose connection falls silent in the middle (after the
// handler's write, before COMMIT) is abandoned within CallTimeout: the
// delivery is deferred (ErrCallTimeout, dedupe.ErrUnavailable), not failed,
// nothing is committed, and once the link heals the same handle serves the
// redelivery, which commits its effect once. On PostgreSQL through
// database/sql and pgx, and on MariaDB.
func TestCallTimeoutDefersACutTransaction(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"postgres", "mysql", "pgx"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			env := testenv.PostgresURLEnv
			if name == "mysql" {
				env = testenv.MySQLURLEnv
			}
			direct := testenv.Postgres
			if name == "mysql" {
				direct = testenv.MySQL
			}
			d := direct(t)
			claims := testenv.DedupeTable(t, d)
			effects := testenv.Name(t, "fx")
			_, err := d.ExecContext(t.Context(), "CREATE TABLE "+effects+" (msg VARCHAR(64) NOT NULL)")
			must(t, err)
			t.Cleanup(func() { _, _ = d.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+effects) })
			insert := "INSERT INTO " + effects + " (msg) VALUES (?)"
			if d.Dialect == sqldb.Postgres {
				insert = "INSERT INTO " + effects + " (msg) VALUES ($1)"
			}
			proxy, u := partitionedDB(t, env)
			const timeout = 500 * time.Millisecond
			cutNext := true
			cut := func() {
				if cutNext {
					cutNext = false
					proxy.Cut()
				}
			}
			work := func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
				_, err := ex.Exec(ctx, insert, msg.UUID)
				cut()
				return err
			}
			var h message.NoPublishHandlerFunc
			if name == "pgx" {
				pc, err := pgxpool.ParseConfig(u)
				must(t, err)
				pc.MaxConns = 1
				pool, err := pgxpool.NewWithConfig(context.Background(), pc)
				must(t, err)
				t.Cleanup(pool.Close)
				h, _ = txHandlerOn(t, sqldb.Pgx(pool), claims, pipeline.TxConfig[pgx.Tx]{OneStatement: true, CallTimeout: timeout, BusyDelay: 10 * time.Millisecond}, work)
			} else {
				db, dialect, err := sqlurl.Open(u)
				must(t, err)
				t.Cleanup(func() { _ = db.Close() })
				db.SetMaxOpenConns(1)
				h, _ = txHandlerOn(t, sqldb.Std(db, dialect), claims, pipeline.TxConfig[*sql.Tx]{OneStatement: true, CallTimeout: timeout, BusyDelay: 10 * time.Millisecond}, work)
			}
			effectRows := func() int {
				var n int
				must(t, d.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+effects).Scan(&n))
				return n
			}

			start := time.Now()
			err = h(message.NewMessage("order-1", nil))
			took := time.Since(start)
			if !errors.Is(err, pipeline.ErrCallTimeout) || !errors.Is(err, dedupe.ErrUnavailable) {
				t.Fatalf("a COMMIT cut off returned %v; want an error wrapping ErrCallTimeout and dedupe.ErrUnavailable", err)
			}
			if took > 10*timeout {
				t.Fatalf("the cut-off delivery took %v; want about CallTimeout (%v)", took, timeout)
			}
			// The redelivery while the link is still cut: deferred again,
			// at BEGIN (or at the claim), within the bound.
			start = time.Now()
			err = h(message.NewMessage("order-1", nil))
			if took := time.Since(start); !errors.Is(err, dedupe.ErrUnavailable) || took > 10*timeout {
				t.Fatalf("a delivery on a cut link returned %v after %v; want it deferred within about %v", err, took, timeout)
			}
			if n := effectRows(); n != 0 {
				t.Fatalf("%d effect rows committed by transactions that were cut", n)
			}
			proxy.Heal()
			// The same handle, on its one connection, does the work once the
			// link is back (the server may still be ending the cut
			// transaction, whose lock then defers the key for a moment).
			deadline := time.Now().Add(30 * time.Second)
			for {
				err = h(message.NewMessage("order-1", nil))
				if err == nil {
					break
				}
				if !errors.Is(err, dedupe.ErrUnavailable) && !errors.Is(err, dedupe.ErrBusy) || time.Now().After(deadline) {
					t.Fatalf("after the heal: %v", err)
				}
				time.Sleep(50 * time.Millisecond)
			}
			must(t, h(message.NewMessage("order-1", nil))) // a duplicate now
			if n := effectRows(); n != 1 {
				t.Fatalf("%d effect rows; want 1", n)
			}
		})
	}
}

func TestCallTimeoutRefusesBadConfig(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: std(db), CallTimeout: -time.Second}, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil }); err == nil || !strings.Contains(err.Error(), "TxConfig.CallTimeout") {
		t.Errorf("negative TxConfig.CallTimeout: %v; want it refused by name", err)
	}
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(nil), CallTimeout: -time.Second}, func(context.Context, pgx.Tx, *message.Message, message.Publisher) error { return nil }); err == nil || !strings.Contains(err.Error(), "TxConfig.CallTimeout") {
		t.Errorf("negative CallTimeout on pgx: %v; want it refused by name", err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	must(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer ps.Close()
	for _, cfg := range []pipeline.Config{
		{Publisher: ps, StoreTimeout: -time.Second},
	} {
		if _, err := pipeline.New(router, cfg); err == nil || !strings.Contains(err.Error(), "StoreTimeout") {
			t.Errorf("New(StoreTimeout %v, ClaimTimeout %v) = %v; want an error naming StoreTimeout", cfg.StoreTimeout, cfg.ClaimTimeout, err)
		}
	}
}

// infoLog records Info lines.
type infoLog struct {
	watermill.LoggerAdapter
	mu    sync.Mutex
	lines []string
}

func (l *infoLog) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	l.lines = append(l.lines, msg)
	l.mu.Unlock()
}

func (l *infoLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// On MariaDB, whose sessions settle does not change, a transactional
// handler added on connections without idle_transaction_timeout is told so,
// and one whose DSN sets it as docs/operating.md says is not.
func TestHandleTxTellsWhatMariaDBLacks(t *testing.T) {
	t.Parallel()
	u := testenv.Require(t, testenv.MySQLURLEnv)
	for _, c := range []struct {
		params string
		warned bool
	}{{"", true}, {"innodb_lock_wait_timeout=7&idle_transaction_timeout=30", false}} {
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		dsn := u
		if c.params != "" {
			dsn += sep + c.params
		}
		db, dialect, err := sqlurl.Open(dsn)
		must(t, err)
		t.Cleanup(func() { _ = db.Close() })
		store := claimsTable(t, stdOf(testenv.DB{DB: db, Dialect: dialect}))
		log := &infoLog{LoggerAdapter: watermill.NopLogger{}}
		router, err := message.NewRouter(message.RouterConfig{}, nil)
		must(t, err)
		ps := gochannel.NewGoChannel(gochannel.Config{}, nil)
		defer ps.Close()
		p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: store, Logger: log})
		must(t, err)
		_, err = pipeline.HandleTx(p, "charge", "orders", ps, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(db, dialect)}, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil })
		must(t, err)
		warned := false
		for _, l := range log.lines {
			warned = warned || strings.Contains(l, "idle_transaction_timeout")
		}
		if warned != c.warned {
			t.Errorf("DSN params %q: told about idle_transaction_timeout %v, want %v (lines %q)", c.params, warned, c.warned, log.lines)
		}
	}
}
