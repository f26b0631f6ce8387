package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"modernc.org/sqlite"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/dedupe/dedupetest"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// The store recognises MySQL's deadlock (1213) by the driver's error type
// without importing the driver. A real deadlock on MariaDB, with the store's
// Prune as its victim: outside a transaction the store runs the statement
// again (the server rolled it back whole) and the prune succeeds; inside a
// caller's transaction the deadlock goes to the caller and nothing is run
// again in the transaction the server rolled back (on MySQL a statement
// after that runs outside any transaction, and would commit by itself).
func TestReview25MySQLDeadlockRetriedOutsideATransaction(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t)
	store, table, pruneAll := deadlockFixture(t, db)
	err := mysqlDeadlock(t, db, table, store, false, func(ctx context.Context, s *dedupe.SQLStore[*sql.Tx]) error {
		n, err := s.Prune(ctx, pruneAll)
		if err == nil && n != deadlockRows {
			return fmt.Errorf("pruned %d rows, want %d", n, deadlockRows)
		}
		return err
	})
	if err != nil {
		t.Fatalf("Prune on the pool, the victim of a deadlock: %v; want it run again and succeed", err)
	}
}

func TestReview25MySQLDeadlockInATransactionGoesToTheCaller(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t)
	store, table, pruneAll := deadlockFixture(t, db)
	err := mysqlDeadlock(t, db, table, store, true, func(ctx context.Context, s *dedupe.SQLStore[*sql.Tx]) error {
		_, err := s.Prune(ctx, pruneAll)
		return err
	})
	var me *mysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1213 {
		t.Fatalf("Prune in a transaction, the victim of a deadlock: %v; want the deadlock (1213) returned", err)
	}
	var n int
	if err := db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM `"+table+"`").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != deadlockRows {
		t.Fatalf("%d rows left after the rolled-back prune, want %d: a statement ran again outside the caller's transaction", n, deadlockRows)
	}
}

const deadlockRows = 20

// deadlockFixture is a claims table of deadlockRows confirmed keys, k00 to
// k19, and the cutoff that prunes them all.
func deadlockFixture(t *testing.T, db testenv.DB) (*dedupe.SQLStore[*sql.Tx], string, time.Time) {
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for i := range deadlockRows {
		if _, err := store.ClaimConfirmed(t.Context(), fmt.Sprintf("k%02d", i)); err != nil {
			t.Fatal(err)
		}
	}
	return store, table, time.Now().Add(time.Hour)
}

// mysqlDeadlock runs op (on store, or on store.WithTx of a transaction when
// inTx) into a deadlock with a heavier transaction, which InnoDB keeps:
// the blocker locks the last key, op locks the others and waits for it, and
// the blocker then asks for the first. It returns op's error.
func mysqlDeadlock(t *testing.T, db testenv.DB, table string, store *dedupe.SQLStore[*sql.Tx], inTx bool,
	op func(context.Context, *dedupe.SQLStore[*sql.Tx]) error) error {
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	table = "`" + table + "`"
	heavy := testenv.Name(t, "heavy")
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+heavy+" (id INT PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+heavy) })
	blocker, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback()
	// Heavy: InnoDB rolls back the transaction that changed fewer rows.
	var b strings.Builder
	b.WriteString("INSERT INTO " + heavy + " (id) VALUES (0)")
	for i := 1; i < 2000; i++ {
		fmt.Fprintf(&b, ", (%d)", i)
	}
	if _, err := blocker.ExecContext(ctx, b.String()); err != nil {
		t.Fatal(err)
	}
	last := fmt.Sprintf("k%02d", deadlockRows-1)
	if _, err := blocker.ExecContext(ctx, "SELECT 1 FROM "+table+" WHERE `key` = ? FOR UPDATE", []byte(last)); err != nil {
		t.Fatal(err)
	}
	var victimTx *sql.Tx
	s := store
	if inTx {
		if victimTx, err = db.BeginTx(ctx, nil); err != nil {
			t.Fatal(err)
		}
		defer victimTx.Rollback()
		s = store.WithTx(victimTx)
	}
	opErr := make(chan error, 1)
	go func() { opErr <- op(ctx, s) }()
	// Wait until op waits for the blocker's lock. (MariaDB's innodb_trx
	// does not list an autocommit statement that waits; its processlist
	// does.)
	for {
		var waiting int
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE ? AND state = 'Updating' AND time_ms > 300",
			"DELETE FROM "+table+"%").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case err := <-opErr:
			t.Fatalf("op ended before it waited for the blocker: %v", err)
		case <-ctx.Done():
			t.Fatal("op never waited for the blocker's lock")
		case <-time.After(20 * time.Millisecond):
		}
	}
	if _, err := blocker.ExecContext(ctx, "SELECT 1 FROM "+table+" WHERE `key` = ? FOR UPDATE", []byte("k00")); err != nil {
		t.Fatalf("the blocker, not the store's statement, was chosen as the deadlock's victim: %v", err)
	}
	if err := blocker.Rollback(); err != nil {
		t.Fatal(err)
	}
	return <-opErr
}

// Inside a caller's transaction a write refused over a row changed since
// the transaction's snapshot is reported as such, whatever the database:
// PostgreSQL's serialization failure (both drivers), MariaDB's 1020 under
// innodb_snapshot_isolation, SQLite's busy snapshot. The claim was renewed
// beside the transaction after it read the table.
func TestReview25ConflictClassified(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		db    func(testing.TB) testenv.DB
		level string
	}{
		{"postgres", testenv.Postgres, "repeatable-read"},
		{"mysql", testenv.MySQL, "repeatable-read-snapshot-isolation"},
		{"sqlite", testenv.SQLite, "deferred"},
	}
	for _, c := range cases {
		t.Run("std-"+c.name, func(t *testing.T) {
			t.Parallel()
			db := c.db(t)
			var begin func(ctx context.Context) (*sql.Tx, func(), error)
			for _, lv := range isolationLevels(t, db) {
				if lv.name == c.level {
					begin = lv.begin
				}
			}
			if begin == nil {
				t.Skipf("the database has no level %s", c.level)
			}
			conflictCase(t, db, db.Driver(), begin, func(err error) bool {
				var pe interface{ SQLState() string }
				var me *mysql.MySQLError
				var se *sqlite.Error
				return errors.As(err, &pe) && pe.SQLState() == "40001" ||
					errors.As(err, &me) && me.Number == 1020 ||
					errors.As(err, &se) && se.Code() == 517
			})
		})
	}
	t.Run("pgx-postgres", func(t *testing.T) {
		t.Parallel()
		drv := testenv.Pgx(t)
		conflictCase(t, testenv.Postgres(t), drv, func(ctx context.Context) (_ any, _ func(), err error) {
			tx, err := drv.Begin(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead}, "")
			return tx, func() {}, err
		}, func(err error) bool {
			var pe interface{ SQLState() string }
			return errors.As(err, &pe) && pe.SQLState() == "40001"
		})
	})
}

func conflictCase[TTx, B any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx], begin func(ctx context.Context) (B, func(), error), want func(error) bool) {
	ctx := t.Context()
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	c, err := store.Claim(ctx, "k", time.Minute)
	if err != nil || c.Result != dedupe.Acquired {
		t.Fatal(c, err)
	}
	b, end, err := begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer end()
	tx := any(b).(TTx)
	defer drv.Rollback(context.Background(), tx)
	q := `SELECT COUNT(*) FROM "` + table + `"`
	if db.Dialect == sqldb.MySQL {
		q = "SELECT COUNT(*) FROM `" + table + "`"
	}
	if err := drv.Tx(tx).QueryRow(ctx, q, nil, new(int)); err != nil {
		t.Fatal(err)
	}
	if err := store.Renew(ctx, c, time.Minute); err != nil {
		t.Fatal(err)
	}
	err = store.WithTx(tx).Confirm(ctx, c)
	if !want(err) {
		t.Fatalf("Confirm in a transaction whose snapshot predates a renewal: %v; want the database's conflict error", err)
	}
	if !strings.Contains(err.Error(), "roll it back") {
		t.Errorf("the conflict is not said to be one (sqlkit.Conflict did not recognise it): %v", err)
	}
}

// The options users set in their DSN change what the drivers send and
// return: the suite must pass under each. MariaDB: interpolateParams (the
// driver writes the arguments into the text), parseTime, clientFoundRows.
// PostgreSQL: pgx's simple protocol (arguments as literals, text results)
// and no statement cache. (One configuration each: every one is a whole
// run of the suite. All of them, with pgx's exec mode and MariaDB without
// clientFoundRows, passed in the review.)
func TestReview25SQLStoreUnderDSNOptions(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, env, opts string }{
		{"std-mysql-interpolate-foundrows", testenv.MySQLURLEnv, "interpolateParams=true&clientFoundRows=true&parseTime=true"},
		{"std-postgres-simple-protocol", testenv.PostgresURLEnv, "default_query_exec_mode=simple_protocol"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := openWith(t, testenv.Require(t, c.env), c.opts)
			dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
				return sqlHarness(t, db, db.Driver(), dsnLevels(isolationLevels(t, db)), false)
			})
		})
	}
	for _, c := range []struct{ name, opts string }{
		{"pgx-postgres-simple-protocol", "default_query_exec_mode=simple_protocol"},
		{"pgx-postgres-no-statement-cache", "default_query_exec_mode=describe_exec&statement_cache_capacity=0&description_cache_capacity=0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			u := testenv.Require(t, testenv.PostgresURLEnv)
			db := testenv.Postgres(t)
			pool, err := pgxpool.New(context.Background(), withOpts(u, c.opts))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			drv := sqldb.Pgx(pool)
			dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
				return sqlHarness(t, db, drv, dsnLevels(driverLevels(drv, postgresLevels)), false)
			})
		})
	}
}

// dsnLevels are the isolation levels at which the DSN options' runs take
// the suite's transaction cases: READ COMMITTED, SERIALIZABLE, and MariaDB's
// snapshot isolation. An option changes how the statements, their
// arguments and their results and errors travel, which is the same at
// every level; what a level changes (snapshots, locking reads, which
// conflict error the server returns) TestSQLStore runs at every level on
// the same drivers. The levels kept return each kind of error: none to
// speak of, serialization failures and deadlocks, and the snapshot
// isolation's failed locking read. (The levels left out took 4% of the
// package's test time.)
func dsnLevels[TTx any](levels []level[TTx]) []level[TTx] {
	return slices.DeleteFunc(levels, func(l level[TTx]) bool {
		return l.name != "read-committed" && l.name != "serializable" && l.name != "repeatable-read-snapshot-isolation"
	})
}

func withOpts(u, opts string) string {
	if strings.Contains(u, "?") {
		return u + "&" + opts
	}
	return u + "?" + opts
}

// openWith opens u with the DSN options opts, as a user's service does.
func openWith(t *testing.T, u, opts string) testenv.DB {
	t.Helper()
	sqlDB, d, err := sqlurl.Open(withOpts(u, opts))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sqlDB.Close() })
	if err := sqlDB.PingContext(t.Context()); err != nil {
		t.Fatal(err)
	}
	return testenv.DB{DB: sqlDB, Dialect: d}
}

// A handler behind the middleware that holds its transaction past a
// RenewInterval, on a pool of one connection: the renewal waits for the
// connection the handler's transaction holds, and ConfirmTx waits for the
// renewal in flight. The handler must still commit (or the documentation
// must say how large the pool must be).
func TestReview25ConfirmTxOnAOneConnectionPool(t *testing.T) {
	t.Parallel()
	t.Run("pgx-postgres", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		pc, err := pgxpool.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
		if err != nil {
			t.Fatal(err)
		}
		pc.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(t.Context(), pc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		oneConnCase(t, db, sqldb.Pgx(pool))
	})
	t.Run("std-postgres", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		one := testenv.Postgres(t)
		one.SetMaxOpenConns(1)
		oneConnCase(t, db, one.Driver())
	})
}

func oneConnCase[TTx any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx]) {
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	mw := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 3 * time.Second, RenewInterval: 200 * time.Millisecond, StoreTimeout: time.Second})
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := drv.Begin(ctx, nil, "")
		if err != nil {
			return nil, err
		}
		defer func() { _ = drv.Rollback(context.Background(), tx) }()
		time.Sleep(700 * time.Millisecond) // the handler's work, past a renewal
		if err := dedupe.ConfirmTx(ctx, tx); err != nil {
			return nil, err
		}
		return nil, drv.Commit(ctx, tx)
	})
	start := time.Now()
	if _, err := h(message.NewMessage("one-conn", nil)); err != nil {
		t.Fatalf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
	}
	t.Logf("handled in %v", time.Since(start).Round(time.Millisecond))
}

// ConfirmTx with a transaction of another database than the store's (two
// SQLite files, each with the claims table): the claim cannot be confirmed
// there. What does the handler see, and what becomes of the key?
func TestReview25ConfirmTxOnAnotherDatabase(t *testing.T) {
	t.Parallel()
	a, b := testenv.SQLite(t), testenv.SQLite(t)
	table := testenv.DedupeTable(t, a)
	store, err := dedupe.NewSQLStore(a.Driver(), dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range store.Schema() {
		if _, err := b.ExecContext(t.Context(), s); err != nil {
			t.Fatal(err)
		}
	}
	mw := newMiddleware(t, dedupe.Config{Store: store})
	var confirmErr error
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		tx, err := b.BeginTx(msg.Context(), nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback()
		confirmErr = dedupe.ConfirmTx(msg.Context(), tx)
		if confirmErr != nil {
			return nil, confirmErr
		}
		return nil, tx.Commit()
	})
	_, err = h(message.NewMessage("elsewhere", nil))
	t.Logf("ConfirmTx: %v; handler: %v", confirmErr, err)
	if err == nil {
		t.Fatal("a confirmation in another database's transaction was taken as done")
	}
	c, cerr := store.Claim(t.Context(), "elsewhere", time.Minute)
	t.Logf("the key afterwards: %v, %v", c.Result, cerr)
	if errors.Is(confirmErr, dedupe.ErrClaimLost) {
		t.Errorf("ConfirmTx in another database's transaction says the claim was lost (%v), while the store still holds it: the user looks for a takeover, not for the wrong database", confirmErr)
	}
}
