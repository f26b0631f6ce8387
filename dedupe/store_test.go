package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"modernc.org/sqlite"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/dedupe/dedupetest"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

func TestMemoryStore(t *testing.T) {
	t.Parallel()
	dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
		return dedupetest.Harness{Store: dedupe.NewMemoryStore()}
	})
}

// On the MySQL dialect a store claims in one statement with RETURNING where
// the server has it (MariaDB 10.5+), and with a write and a read-back where
// it does not (MySQL). The server here is MariaDB; the second path runs on it
// too, forced ("-readback").
//
// Every database runs the suite through database/sql ("std-"); PostgreSQL
// runs it through pgx too ("pgx-postgres"): the same suite, the same store,
// another driver.
func TestSQLStore(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		for _, readBack := range []bool{false, true} {
			name := "std-" + d.Name
			if readBack {
				if !strings.HasPrefix(d.Name, "mysql") {
					continue
				}
				name += "-readback"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				db := d.Open(t)
				dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
					if db.Dialect == sqldb.SQLite {
						// SQLite locks the whole file: a case's transaction
						// held open on purpose (a zombie's, past its claim)
						// would hold every other case's writes past their
						// busy timeout. Each case gets a database of its own.
						db := d.Open(t)
						return sqlHarness(t, db, db.Driver(), isolationLevels(t, db), readBack)
					}
					return sqlHarness(t, db, db.Driver(), isolationLevels(t, db), readBack)
				})
			})
		}
	}
	// The pgx driver runs the same statements through pgx, on a pool whose
	// connections the concurrent tests spread over.
	t.Run("pgx-postgres", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		drv := testenv.Pgx(t)
		dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
			return sqlHarness(t, db, drv, driverLevels(drv, postgresLevels), false)
		})
	})
}

func TestSQLStoreAsksMariaDBForReturning(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Claim(t.Context(), "k", time.Minute); err != nil {
		t.Fatal(err)
	}
	var version string
	if err := db.QueryRowContext(t.Context(), "SELECT VERSION()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	known, returning := dedupe.ReturningKnown(store)
	if !known || returning != strings.Contains(version, "MariaDB") {
		t.Errorf("server %q: store knows %v, claims with RETURNING %v", version, known, returning)
	}
}

// sqlHarness is the suite's harness for a SQLStore on drv, whose database
// db is (db makes the tables and counts the effects), with the transactions
// of levels.
func sqlHarness[TTx any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx], levels []level[TTx], withoutReturning bool) dedupetest.Harness {
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if withoutReturning {
		dedupe.WithoutReturning(store)
	}
	return storeHarness(t, db, drv, store, table, levels)
}

// storeHarness is sqlHarness for store, on table.
func storeHarness[TTx any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx], store *dedupe.SQLStore[TTx], table string, levels []level[TTx]) dedupetest.Harness {
	fx := newTxFixture(t, db, table)
	var txLevels []dedupetest.TxLevel
	for _, lv := range levels {
		txLevels = append(txLevels, dedupetest.TxLevel{Name: lv.name, Begin: func(ctx context.Context) (dedupetest.Tx, error) {
			tx, end, err := lv.begin(ctx)
			if err != nil {
				return dedupetest.Tx{}, err
			}
			rollback := func() error { return drv.Rollback(context.Background(), tx) }
			t.Cleanup(func() { _ = rollback(); end() })
			ex := drv.Tx(tx)
			if err := fx.snapshot(ctx, ex); err != nil {
				_ = rollback()
				end()
				return dedupetest.Tx{}, err
			}
			return dedupetest.Tx{
				Store:    store.WithTx(tx),
				Commit:   func() error { defer end(); return drv.Commit(ctx, tx) },
				Rollback: func() error { defer end(); return rollback() },
				Effect:   func(ctx context.Context, key string) error { return fx.effect(ctx, ex, key) },
			}, nil
		}})
	}
	return dedupetest.Harness{
		Store: store,
		// Round trips to a server on a loaded machine take milliseconds, and
		// a renewal must land well within the claim's lifetime.
		ClaimTTL:  600 * time.Millisecond,
		TxLevels:  txLevels,
		TxAborted: txAborted,
		Effects:   fx.count,
	}
}

// postgresLevels are PostgreSQL's isolation levels (READ UNCOMMITTED is
// READ COMMITTED there).
var postgresLevels = []struct {
	name string
	iso  sql.IsolationLevel
}{
	{"read-committed", sql.LevelReadCommitted},
	{"repeatable-read", sql.LevelRepeatableRead},
	{"serializable", sql.LevelSerializable},
}

// driverLevels begins the transactions of each level with drv.Begin.
func driverLevels[TTx any](drv sqldb.Driver[TTx], isos []struct {
	name string
	iso  sql.IsolationLevel
}) []level[TTx] {
	var out []level[TTx]
	for _, l := range isos {
		out = append(out, level[TTx]{l.name, func(ctx context.Context) (TTx, func(), error) {
			tx, err := drv.Begin(ctx, &sql.TxOptions{Isolation: l.iso}, "")
			return tx, func() {}, err
		}})
	}
	return out
}

// level is an isolation level a user can set on a database, and how to
// begin a transaction at it; end is called once the transaction is over.
type level[TTx any] struct {
	name  string
	begin func(ctx context.Context) (tx TTx, end func(), err error)
}

// isolationLevels lists every isolation level db's database offers.
// PostgreSQL: READ COMMITTED, REPEATABLE READ, SERIALIZABLE (READ
// UNCOMMITTED is READ COMMITTED there). MySQL/MariaDB: all four, and
// REPEATABLE READ with MariaDB's innodb_snapshot_isolation (the default
// from MariaDB 11.6), under which a locking read of a row changed since the
// snapshot fails. SQLite has no levels: a transaction begun IMMEDIATE (as
// settle's sqlite:// URLs do) or DEFERRED (the driver's default) on a WAL
// database.
func isolationLevels(t *testing.T, db testenv.DB) []level[*sql.Tx] {
	at := func(name string, iso sql.IsolationLevel) level[*sql.Tx] {
		return level[*sql.Tx]{name, func(ctx context.Context) (*sql.Tx, func(), error) {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: iso})
			return tx, func() {}, err
		}}
	}
	switch db.Dialect {
	case sqldb.Postgres:
		return driverLevels(db.Driver(), postgresLevels)
	case sqldb.MySQL:
		levels := []level[*sql.Tx]{
			at("read-uncommitted", sql.LevelReadUncommitted),
			at("read-committed", sql.LevelReadCommitted),
			at("repeatable-read", sql.LevelRepeatableRead),
			at("serializable", sql.LevelSerializable),
		}
		var name, value string
		if err := db.QueryRowContext(t.Context(), "SHOW VARIABLES LIKE 'innodb_snapshot_isolation'").Scan(&name, &value); err == nil {
			levels = append(levels, level[*sql.Tx]{"repeatable-read-snapshot-isolation", func(ctx context.Context) (*sql.Tx, func(), error) {
				conn, err := db.Conn(ctx)
				if err != nil {
					return nil, nil, err
				}
				end := func() {
					_, _ = conn.ExecContext(context.Background(), "SET SESSION innodb_snapshot_isolation = "+value)
					_ = conn.Close()
				}
				if _, err := conn.ExecContext(ctx, "SET SESSION innodb_snapshot_isolation = ON"); err != nil {
					end()
					return nil, nil, err
				}
				tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
				if err != nil {
					end()
					return nil, nil, err
				}
				return tx, end, nil
			}})
		}
		return levels
	}
	var path string
	if err := db.QueryRowContext(t.Context(), "SELECT file FROM pragma_database_list WHERE name = 'main'").Scan(&path); err != nil {
		t.Fatal(err)
	}
	deferred, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = deferred.Close() })
	return []level[*sql.Tx]{
		at("immediate", sql.LevelDefault),
		{"deferred", func(ctx context.Context) (*sql.Tx, func(), error) {
			tx, err := deferred.BeginTx(ctx, nil)
			return tx, func() {}, err
		}},
	}
}

// txAborted reports an error by which the database rolled a transaction
// back over a conflict: a serialization failure or a deadlock (PostgreSQL
// 40001, 40P01; InnoDB 1213, and 1020 under innodb_snapshot_isolation), or
// SQLite's busy snapshot (a deferred transaction that read before another
// connection wrote cannot write).
func txAborted(err error) bool {
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return pe.SQLState() == "40001" || pe.SQLState() == "40P01"
	}
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number == 1213 || me.Number == 1020
	}
	var se *sqlite.Error
	if errors.As(err, &se) {
		return se.Code()&0xff == 5 // SQLITE_BUSY, SQLITE_BUSY_SNAPSHOT
	}
	return false
}

// txFixture is a harness's effect table, and the read that takes a
// transaction's snapshot.
type txFixture struct {
	db             testenv.DB
	table, effects string
}

func newTxFixture(t testing.TB, db testenv.DB, table string) *txFixture {
	fx := &txFixture{db: db, table: table, effects: testenv.Name(t, "ef")}
	if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+fx.effects+" (k VARCHAR(255) NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+fx.effects) })
	return fx
}

func (fx *txFixture) q(query string) string {
	if fx.db.Dialect == sqldb.Postgres {
		return strings.ReplaceAll(query, "?", "$1")
	}
	return query
}

// snapshot reads the claims table in tx, as a handler that reads before it
// confirms does: from here on, at REPEATABLE READ and above, tx reads a
// snapshot.
func (fx *txFixture) snapshot(ctx context.Context, tx sqldb.Executor) error {
	q := "SELECT COUNT(*) FROM " + `"` + fx.table + `"`
	if fx.db.Dialect == sqldb.MySQL {
		q = "SELECT COUNT(*) FROM `" + fx.table + "`"
	}
	return tx.QueryRow(ctx, q, nil, new(int))
}

func (fx *txFixture) effect(ctx context.Context, tx sqldb.Executor, key string) error {
	_, err := tx.Exec(ctx, fx.q("INSERT INTO "+fx.effects+" (k) VALUES (?)"), key)
	return err
}

func (fx *txFixture) count(ctx context.Context, key string) (int, error) {
	var n int
	err := fx.db.QueryRowContext(ctx, fx.q("SELECT COUNT(*) FROM "+fx.effects+" WHERE k = ?"), key).Scan(&n)
	return n, err
}
