package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/blackhole"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// cutAfterConfirm is a pgx tracer that cuts a proxy right after the first
// statement settle runs on the handler's connection once the handler's
// function has returned, other than the server-side timeouts: the
// confirmation of the middleware's claim, which then holds the claim's row
// lock in a transaction whose COMMIT never reaches the server.
type cutAfterConfirm struct {
	proxy    *blackhole.Proxy
	effects  string                   // the handler's table: its statements name it
	conn     atomic.Pointer[pgx.Conn] // the handler's connection
	returned atomic.Bool              // the handler's function has returned
	cut      atomic.Bool
}

type confirmKey struct{}

func (c *cutAfterConfirm) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(data.SQL, c.effects):
		c.conn.Store(conn)
	case c.returned.Load() && conn == c.conn.Load() && !strings.HasPrefix(data.SQL, "SET LOCAL") && !c.cut.Load():
		return context.WithValue(ctx, confirmKey{}, true)
	}
	return ctx
}

func (c *cutAfterConfirm) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if ctx.Value(confirmKey{}) != nil && data.Err == nil && c.cut.CompareAndSwap(false, true) {
		c.proxy.Cut()
	}
}

// In the default mode (behind the dedupe middleware) settle sets its
// server-side limits after the handler's function, not at BEGIN; they must
// still bound what comes after: a consumer cut off by a silent partition
// right after its confirmation landed, before its COMMIT does, holds the
// claim's row lock in a transaction the server must end
// (idle_in_transaction_session_timeout), or the key is held for good by a
// client that is gone. Consumer A (through a proxy) is cut there; consumer B
// (direct) must then take the key over once A's claim has expired, and do
// its effect once, A's rolled back. Through database/sql and pgx.
func TestDefaultModeLimitsBoundACutCommit(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"postgres", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			direct := testenv.Postgres(t)
			claims := testenv.DedupeTable(t, direct)
			effects := testenv.Name(t, "fx")
			_, err := direct.ExecContext(t.Context(), `CREATE TABLE "`+effects+`" (msg TEXT NOT NULL, consumer TEXT NOT NULL)`)
			must(t, err)
			t.Cleanup(func() { _, _ = direct.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+effects+`"`) })
			insert := `INSERT INTO "` + effects + `" (msg, consumer) VALUES ($1, $2)`

			u, err := url.Parse(testenv.Require(t, testenv.PostgresURLEnv))
			must(t, err)
			proxy, err := blackhole.New(u.Host)
			must(t, err)
			t.Cleanup(func() { _ = proxy.Close() })
			u.Host = proxy.Addr()
			tracer := &cutAfterConfirm{proxy: proxy, effects: effects}
			cc, err := pgx.ParseConfig(u.String())
			must(t, err)
			cc.Tracer = tracer

			const callTimeout = 500 * time.Millisecond
			const claimTimeout = 2 * time.Second
			// consumer builds one consumer's stack: the middleware, then
			// the transactional handler, on db (database/sql) or pool.
			consumer := func(name string, db *sql.DB, pool *pgxpool.Pool, returned *atomic.Bool) func(*message.Message) error {
				cfg := pipeline.TxConfig[*sql.Tx]{CallTimeout: callTimeout, BusyDelay: 10 * time.Millisecond}
				work := func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
					_, err := ex.Exec(ctx, insert, msg.UUID, name)
					returned.Store(true)
					return err
				}
				var store dedupe.Store
				var h message.NoPublishHandlerFunc
				if pool != nil {
					h, store = txHandlerOn(t, sqldb.Pgx(pool), claims, pipeline.TxConfig[pgx.Tx]{CallTimeout: cfg.CallTimeout, BusyDelay: cfg.BusyDelay}, work)
				} else {
					h, store = txHandlerOn(t, sqldb.Std(db, sqldb.Postgres), claims, cfg, work)
				}
				mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: claimTimeout, StoreTimeout: callTimeout, BusyDelay: 10 * time.Millisecond})
				must(t, err)
				wrapped := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
				return func(msg *message.Message) error {
					msg.SetContext(t.Context())
					_, err := wrapped(msg)
					return err
				}
			}
			var a, b func(*message.Message) error
			var bReturned atomic.Bool
			if driver == "pgx" {
				pc, err := pgxpool.ParseConfig(u.String())
				must(t, err)
				pc.ConnConfig = cc
				poolA, err := pgxpool.NewWithConfig(context.Background(), pc)
				must(t, err)
				t.Cleanup(poolA.Close)
				t.Cleanup(func() { _ = proxy.Close() }) // before the pool closes: ends what the cut left blocked
				a = consumer("a", nil, poolA, &tracer.returned)
				b = consumer("b", nil, testenv.PgxPool(t), &bReturned)
			} else {
				dbA := stdlib.OpenDB(*cc)
				t.Cleanup(func() { _ = dbA.Close() })
				t.Cleanup(func() { _ = proxy.Close() })
				a = consumer("a", dbA, nil, &tracer.returned)
				b = consumer("b", direct.DB, nil, &bReturned)
			}

			err = a(message.NewMessage("order-1", nil))
			if !tracer.cut.Load() {
				t.Fatalf("A was never cut after its confirmation (its result: %v)", err)
			}
			if !errors.Is(err, dedupe.ErrUnavailable) {
				t.Fatalf("A, cut before its COMMIT landed, returned %v; want it deferred (dedupe.ErrUnavailable)", err)
			}
			// B takes the key once A's claim has expired and the server
			// has ended A's transaction, never while it holds the row.
			start := time.Now()
			for {
				err := b(message.NewMessage("order-1", nil))
				if err == nil {
					break
				}
				if !errors.Is(err, dedupe.ErrUnavailable) && !errors.Is(err, dedupe.ErrBusy) {
					t.Fatalf("B: %v", err)
				}
				if time.Since(start) > 10*claimTimeout {
					t.Fatalf("B could not take the key %v after A was cut past its confirmation: %v", time.Since(start), err)
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("B did the key %v after A was cut", time.Since(start).Round(10*time.Millisecond))
			var rows int
			var by string
			must(t, direct.QueryRowContext(t.Context(), `SELECT COUNT(*), COALESCE(MIN(consumer), '') FROM "`+effects+`"`).Scan(&rows, &by))
			if rows != 1 || by != "b" {
				t.Fatalf("%d effect rows (first by %q); want B's alone", rows, by)
			}
		})
	}
}
