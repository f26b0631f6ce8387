package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// stmtLog is a pgx tracer that records every statement sent (BEGIN and
// COMMIT included), as the bench's anchors section counts them.
type stmtLog struct {
	mu   sync.Mutex
	sqls []string
}

func (l *stmtLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	l.sqls = append(l.sqls, strings.Join(strings.Fields(d.SQL), " "))
	l.mu.Unlock()
	return ctx
}

func (l *stmtLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// take returns the statements recorded since the last take.
func (l *stmtLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.sqls
	l.sqls = nil
	return s
}

// pgOn is a PostgreSQL database opened through database/sql (pgx's
// stdlib) or pgx's pool, its sessions defaulting to level ("" for the
// server's default), every statement recorded in log; at most conns
// connections (0: the driver's default).
type pgOn struct {
	std *sql.DB
	pgx *pgxpool.Pool
}

func openPG(t *testing.T, driver, level string, conns int, log *stmtLog) pgOn {
	t.Helper()
	u := testenv.Require(t, testenv.PostgresURLEnv)
	if level != "" {
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		u += sep + "options=-c%20default_transaction_isolation%3D" + strings.ReplaceAll(level, " ", "%5C%20")
	}
	if driver == "pgx" {
		pc, err := pgxpool.ParseConfig(u)
		must(t, err)
		if log != nil {
			pc.ConnConfig.Tracer = log
		}
		if conns > 0 {
			pc.MaxConns = int32(conns)
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), pc)
		must(t, err)
		t.Cleanup(pool.Close)
		return pgOn{pgx: pool}
	}
	cc, err := pgx.ParseConfig(u)
	must(t, err)
	if log != nil {
		cc.Tracer = log
	}
	db := stdlib.OpenDB(*cc)
	if conns > 0 {
		db.SetMaxOpenConns(conns)
	}
	t.Cleanup(func() { _ = db.Close() })
	return pgOn{std: db}
}

// handler builds a transactional handler on p running fn (behind a dedupe
// middleware on store's pool if mw is set), with its claims in claims.
// store is p itself when nil.
func (p pgOn) handler(t *testing.T, claims string, store *pgOn, cfg pipeline.TxConfig[*sql.Tx], mw *dedupe.Config, fn stmtFunc) (func(*message.Message) error, dedupe.Store) {
	t.Helper()
	if store == nil {
		store = &p
	}
	var (
		h message.NoPublishHandlerFunc
		s dedupe.Store
	)
	if p.pgx != nil {
		st, err := dedupe.NewSQLStore(sqldb.Pgx(store.pgx), dedupe.SQLConfig{Table: claims})
		must(t, err)
		d := sqldb.Pgx(p.pgx)
		h, err = pipeline.NewTxHandler(pipeline.TxConfig[pgx.Tx]{DB: d, Store: st, OneStatement: cfg.OneStatement, TxOptions: cfg.TxOptions,
			CallTimeout: cfg.CallTimeout, BusyDelay: cfg.BusyDelay},
			func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ message.Publisher) error {
				return fn(ctx, d.Tx(tx), msg)
			})
		must(t, err)
		s = st
	} else {
		st, err := dedupe.NewSQLStore(sqldb.Std(store.std, sqldb.Postgres), dedupe.SQLConfig{Table: claims})
		must(t, err)
		d := sqldb.Std(p.std, sqldb.Postgres)
		cfg.DB, cfg.Store = d, st
		h, err = pipeline.NewTxHandler(cfg, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			return fn(ctx, d.Tx(tx), msg)
		})
		must(t, err)
		s = st
	}
	if mw == nil {
		return func(m *message.Message) error { m.SetContext(t.Context()); return h(m) }, s
	}
	c := *mw
	c.Store = s
	dd, err := dedupe.NewMiddleware(c)
	must(t, err)
	stack := dd(func(m *message.Message) ([]*message.Message, error) { return nil, h(m) })
	return func(m *message.Message) error { m.SetContext(t.Context()); _, err := stack(m); return err }, s
}

// effectsTable creates a table of effects, one row per run that commits.
func effectsTable(t *testing.T) (db testenv.DB, table string) {
	t.Helper()
	db = testenv.Postgres(t)
	table = testenv.Name(t, "fx")
	_, err := db.ExecContext(t.Context(), `CREATE TABLE "`+table+`" (msg TEXT NOT NULL)`)
	must(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`"`) })
	return db, table
}

// What settle sends per delivery on PostgreSQL, counted on the wire as the
// bench's anchors section counts it, at each isolation level a session may
// default to, through database/sql and pgx: the default mode sends the
// claim, BEGIN, the confirmation and COMMIT (and, at REPEATABLE READ and
// SERIALIZABLE, the hold's renewal in the transaction), OneStatement
// BEGIN, the claim and COMMIT; neither a SHOW of the isolation level nor a
// SET LOCAL of the timeouts. The level comes from TxOptions when set, else
// from the confirmation of the transaction before (the first asks it): the
// second delivery's handler outlives several renewals after taking its
// snapshot, which at REPEATABLE READ and SERIALIZABLE commits only if its
// claim was held in the transaction, as the level requires. Every delivery
// runs once and commits once, its key confirmed after one attempt.
func TestRoundTripsPerDelivery(t *testing.T) {
	t.Parallel()
	modes := []struct {
		name     string
		explicit bool // TxOptions names the session's level
		one      bool // OneStatement, no middleware
	}{{"default", false, false}, {"default-txoptions", true, false}, {"one-statement", false, true}}
	levels := map[string]sql.IsolationLevel{"read committed": sql.LevelReadCommitted, "repeatable read": sql.LevelRepeatableRead, "serializable": sql.LevelSerializable}
	for _, driver := range []string{"postgres", "pgx"} {
		for level, iso := range levels {
			for _, mode := range modes {
				t.Run(driver+"/"+strings.ReplaceAll(level, " ", "-")+"/"+mode.name, func(t *testing.T) {
					t.Parallel()
					direct, effects := effectsTable(t)
					claims := testenv.DedupeTable(t, direct)
					log := &stmtLog{}
					p := openPG(t, driver, level, 0, log)
					cfg := pipeline.TxConfig[*sql.Tx]{OneStatement: mode.one, BusyDelay: time.Millisecond}
					if mode.explicit {
						cfg.TxOptions = &sql.TxOptions{Isolation: iso}
					}
					var mw *dedupe.Config
					if !mode.one {
						mw = &dedupe.Config{ClaimTimeout: 600 * time.Millisecond, RenewInterval: 100 * time.Millisecond, BusyDelay: time.Millisecond}
					}
					var runs atomic.Int64
					handle, store := p.handler(t, claims, nil, cfg, mw, func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
						var n int
						if err := ex.QueryRow(ctx, `SELECT COUNT(*) FROM "`+effects+`"`, nil, &n); err != nil {
							return err // the snapshot is taken here, if not by the hold
						}
						if runs.Add(1) == 2 {
							time.Sleep(450 * time.Millisecond) // four renewals
						}
						_, err := ex.Exec(ctx, `INSERT INTO "`+effects+`" (msg) VALUES ($1)`, msg.UUID)
						return err
					})
					var keys []string
					var counted []string
					for i := range 4 {
						msg := message.NewMessage(watermill.NewUUID(), nil)
						keys = append(keys, msg.UUID)
						log.take()
						if err := handle(msg); err != nil {
							t.Fatalf("delivery %d: %v (statements: %q)", i+1, err, log.take())
						}
						if i >= 2 {
							counted = append(counted, log.take()...)
						}
					}
					want := 4 // the claim, BEGIN, the confirmation, COMMIT
					switch {
					case mode.one:
						want = 3 // BEGIN, the claim, COMMIT
					case level != "read committed":
						want = 5 // and the hold's renewal
					}
					want += 2 // the handler's
					for _, s := range counted {
						if strings.HasPrefix(s, "SHOW") || strings.Contains(s, "SET LOCAL") {
							t.Errorf("sent %q, a round trip of its own", s)
						}
					}
					if got := float64(len(counted)) / 2; got != float64(want) {
						t.Errorf("%.1f statements per delivery, want %d: %q", got, want, counted)
					}
					if n := runs.Load(); n != 4 {
						t.Errorf("the handler ran %d times for 4 deliveries", n)
					}
					var rows int
					must(t, direct.QueryRowContext(t.Context(), `SELECT COUNT(DISTINCT msg) FROM "`+effects+`"`).Scan(&rows))
					if rows != 4 {
						t.Errorf("%d deliveries' effects, want 4", rows)
					}
					if !mode.one {
						for _, k := range keys {
							settledAfterOne(t, store, k)
						}
					}
				})
			}
		}
	}
}

// The server-side limits that settle's statements set for themselves (the
// confirmation's in the default mode, the claim's with OneStatement) hold
// for the statement that sets them: another connection holds the claims'
// rows (as a client that vanished in the middle of a transaction would),
// and the confirmation or claim that waits for the key's row fails with
// lock_timeout (55P03) at CallTimeout/2, rather than waiting until settle
// abandons the call at CallTimeout (ErrCallTimeout, the connection
// closed). Through database/sql and pgx.
func TestCarriedLimitsBoundLockWaits(t *testing.T) {
	t.Parallel()
	const callTimeout = 1200 * time.Millisecond
	for _, driver := range []string{"postgres", "pgx"} {
		for _, one := range []bool{false, true} {
			name := driver + "/default"
			if one {
				name = driver + "/one-statement"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				direct, effects := effectsTable(t)
				claims := testenv.DedupeTable(t, direct)
				p := openPG(t, driver, "", 0, nil)
				var locker *sql.Tx
				lock := func(ctx context.Context) error {
					var err error
					if locker, err = direct.BeginTx(ctx, nil); err != nil {
						return err
					}
					_, err = locker.ExecContext(ctx, `SELECT 1 FROM "`+claims+`" FOR UPDATE`)
					return err
				}
				t.Cleanup(func() {
					if locker != nil {
						_ = locker.Rollback()
					}
				})
				var mw *dedupe.Config
				if !one {
					mw = &dedupe.Config{ClaimTimeout: 10 * time.Second, StoreTimeout: callTimeout}
				}
				cfg := pipeline.TxConfig[*sql.Tx]{OneStatement: one, CallTimeout: callTimeout, BusyDelay: time.Millisecond}
				var locking atomic.Bool
				handle, _ := p.handler(t, claims, nil, cfg, mw, func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
					if locking.Load() && !one {
						// The claim is taken: hold its row, which the
						// confirmation will write.
						if err := lock(ctx); err != nil {
							return err
						}
					}
					_, err := ex.Exec(ctx, `INSERT INTO "`+effects+`" (msg) VALUES ($1)`, msg.UUID)
					return err
				})
				msg := message.NewMessage(watermill.NewUUID(), nil)
				if one {
					// The key's row, confirmed; held then, the claim of
					// its redelivery waits for it.
					must(t, handle(msg))
					must(t, lock(t.Context()))
				}
				locking.Store(true)
				err := handle(message.NewMessage(msg.UUID, nil))
				if err == nil {
					t.Fatal("the delivery went through a row lock held elsewhere")
				}
				if errors.Is(err, pipeline.ErrCallTimeout) || sqlkit.SQLState(err) != "55P03" {
					t.Fatalf("the statement waiting for the lock ended with %v; want lock_timeout's 55P03, not settle's deadline", err)
				}
				if !errors.Is(err, dedupe.ErrUnavailable) {
					t.Errorf("%v: want the delivery deferred (dedupe.ErrUnavailable)", err)
				}
			})
		}
	}
}

// A transaction at the session's default level that the hold took to be
// READ COMMITTED, from the transactions before it, but that reads a
// snapshot (the session's default changed): the renewal beside it lands
// after its snapshot and its confirmation fails with a serialization
// failure. It is run again, the level asked this time, and commits: one
// effect, the key confirmed after one attempt. Through database/sql and
// pgx, the handler's transactions on a pool of one connection, the claims
// on another pool.
func TestGuessedLevelWrongRunsAgain(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"postgres", "pgx"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			direct, effects := effectsTable(t)
			claims := testenv.DedupeTable(t, direct)
			log := &stmtLog{}
			p := openPG(t, driver, "", 1, log)
			claimsPool := openPG(t, driver, "", 0, nil)
			var runs atomic.Int64
			slow := false
			handle, store := p.handler(t, claims, &claimsPool, pipeline.TxConfig[*sql.Tx]{BusyDelay: time.Millisecond},
				&dedupe.Config{ClaimTimeout: 600 * time.Millisecond, RenewInterval: 100 * time.Millisecond, BusyDelay: time.Millisecond},
				func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error {
					var n int
					if err := ex.QueryRow(ctx, `SELECT COUNT(*) FROM "`+effects+`"`, nil, &n); err != nil {
						return err
					}
					runs.Add(1)
					if slow {
						time.Sleep(450 * time.Millisecond) // four renewals
					}
					_, err := ex.Exec(ctx, `INSERT INTO "`+effects+`" (msg) VALUES ($1)`, msg.UUID)
					return err
				})
			// The first delivery, at READ COMMITTED, teaches the store the level.
			must(t, handle(message.NewMessage(watermill.NewUUID(), nil)))
			setDefault := `SET SESSION default_transaction_isolation = 'repeatable read'`
			if p.pgx != nil {
				_, err := p.pgx.Exec(t.Context(), setDefault)
				must(t, err)
			} else {
				_, err := p.std.ExecContext(t.Context(), setDefault)
				must(t, err)
			}
			slow = true
			runs.Store(0)
			log.take()
			msg := message.NewMessage(watermill.NewUUID(), nil)
			if err := handle(msg); err != nil {
				t.Fatalf("the delivery at REPEATABLE READ taken for READ COMMITTED: %v (statements: %q)", err, log.take())
			}
			sent := log.take()
			shows := 0
			for _, s := range sent {
				if strings.HasPrefix(s, "SHOW transaction_isolation") {
					shows++
				}
			}
			if n := runs.Load(); n != 2 || shows != 1 {
				t.Errorf("the handler ran %d times, the level was asked %d times; want 2 runs, the second after asking (statements: %q)", n, shows, sent)
			}
			var rows int
			must(t, direct.QueryRowContext(t.Context(), `SELECT COUNT(*) FROM "`+effects+`" WHERE msg = $1`, msg.UUID).Scan(&rows))
			if rows != 1 {
				t.Errorf("%d effect rows, want 1", rows)
			}
			settledAfterOne(t, store, msg.UUID)
		})
	}
}
