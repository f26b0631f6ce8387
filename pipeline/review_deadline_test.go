package pipeline_test

import (
	"context"
	"database/sql"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// review: in the default mode (the dedupe middleware in front), TxConfig's
// doc says the handler's function "runs as long as it takes": only
// settle's own calls get CallTimeout. On PostgreSQL, though, the
// transaction set idle_in_transaction_session_timeout to 2*CallTimeout
// and lock_timeout to CallTimeout/2 for itself at BEGIN, and these bound
// the handler's own work: a handler that calls a slow service between two
// statements (longer than 2*CallTimeout) had its session terminated by the
// server (run again, then deferred, for ever), and one whose statement
// waits for a row lock longer than CallTimeout/2 failed (an attempt). Both
// must run once and commit their effect once, the key confirmed after one
// attempt; through database/sql and pgx.
func TestReviewDefaultModeHandlerOutlivesCallTimeout(t *testing.T) {
	t.Parallel()
	const callTimeout = 300 * time.Millisecond
	for _, driver := range []string{"postgres", "pgx"} {
		for _, c := range []string{"idle", "lock"} {
			t.Run(c+"/"+driver, func(t *testing.T) {
				t.Parallel()
				db := testenv.Postgres(t)
				charges := testenv.Name(t, "charges")
				_, err := db.ExecContext(t.Context(), `CREATE TABLE "`+charges+`" (order_id TEXT PRIMARY KEY, cents INTEGER NOT NULL)`)
				must(t, err)
				t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+charges+`"`) })
				claims := testenv.DedupeTable(t, db)

				// The handler's work, whatever the driver: exec runs one
				// of its statements in its transaction.
				var work func(ctx context.Context, exec func(q string, args ...any) error, msg *message.Message) error
				switch c {
				case "idle":
					work = func(ctx context.Context, exec func(string, ...any) error, msg *message.Message) error {
						if err := exec(`INSERT INTO "`+charges+`" (order_id, cents) VALUES ($1, 1)`, msg.UUID); err != nil {
							return err
						}
						time.Sleep(6 * callTimeout) // a slow payment service
						return exec(`UPDATE "`+charges+`" SET cents = 2 WHERE order_id = $1`, msg.UUID)
					}
				case "lock":
					_, err := db.ExecContext(t.Context(), `INSERT INTO "`+charges+`" (order_id, cents) VALUES ('shared', 0)`)
					must(t, err)
					// Another transaction holds the row for a while, then
					// commits.
					other, err := db.BeginTx(t.Context(), nil)
					must(t, err)
					_, err = other.ExecContext(t.Context(), `UPDATE "`+charges+`" SET cents = cents + 1 WHERE order_id = 'shared'`)
					must(t, err)
					time.AfterFunc(4*callTimeout, func() { _ = other.Commit() })
					work = func(ctx context.Context, exec func(string, ...any) error, _ *message.Message) error {
						return exec(`UPDATE "` + charges + `" SET cents = cents + 10 WHERE order_id = 'shared'`)
					}
				}

				var runs atomic.Int64
				run := func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
					runs.Add(1)
					return work(ctx, func(q string, args ...any) error { _, err := ex.Exec(ctx, q, args...); return err }, msg)
				}
				var store dedupe.Store
				var h message.NoPublishHandlerFunc
				if driver == "pgx" {
					h, store = txHandlerOn(t, sqldb.Pgx(testenv.PgxPool(t)), claims, pipeline.TxConfig[pgx.Tx]{CallTimeout: callTimeout}, run)
				} else {
					h, store = txHandlerOn(t, std(db), claims, pipeline.TxConfig[*sql.Tx]{CallTimeout: callTimeout}, run)
				}
				mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: 5 * time.Second})
				must(t, err)
				handler := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
				msg := message.NewMessage(watermill.NewUUID(), nil)
				msg.SetContext(t.Context())
				if _, err := handler(msg); err != nil {
					t.Fatalf("a handler that outlives the call timeout (%s) failed after %d runs: %v", c, runs.Load(), err)
				}
				if n := runs.Load(); n != 1 {
					t.Errorf("the handler ran %d times, want 1", n)
				}
				var rows, cents int
				must(t, db.QueryRowContext(t.Context(), `SELECT COUNT(*), COALESCE(SUM(cents), 0) FROM "`+charges+`"`).Scan(&rows, &cents))
				want := map[string]int{"idle": 2, "lock": 11}[c]
				if rows != 1 || cents != want {
					t.Errorf("%d charge rows, %d cents; want 1 row of %d", rows, cents, want)
				}
				settledAfterOne(t, store, msg.UUID)
			})
		}
	}
}

// settledAfterOne requires key to be confirmed after one attempt.
func settledAfterOne(t *testing.T, store dedupe.Store, key string) {
	t.Helper()
	c, err := store.Claim(t.Context(), key, time.Minute)
	must(t, err)
	if c.Result != dedupe.Duplicate || c.Attempt != 1 {
		t.Errorf("key %s: %v after %d attempts, want confirmed after 1", key, c.Result, c.Attempt)
	}
}

// review: a CallTimeout or Config.StoreTimeout no database answers within
// (1ns, 1µs) is refused by name: accepted, it deferred every delivery for
// ever without a run.
func TestReviewTinyCallTimeoutRefused(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for _, d := range []time.Duration{time.Nanosecond, time.Microsecond, 9 * time.Millisecond} {
		_, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: std(db), CallTimeout: d}, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil })
		if err == nil || !strings.Contains(err.Error(), "TxConfig.CallTimeout") {
			t.Errorf("CallTimeout %v: %v; want it refused by name", d, err)
		}
		router, err := message.NewRouter(message.RouterConfig{}, nil)
		must(t, err)
		if _, err := pipeline.New(router, pipeline.Config{Publisher: gochannel.NewGoChannel(gochannel.Config{}, nil), StoreTimeout: d}); err == nil || !strings.Contains(err.Error(), "StoreTimeout") {
			t.Errorf("Config.StoreTimeout %v: %v; want it refused by name", d, err)
		}
	}
}
