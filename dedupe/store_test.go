package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"modernc.org/sqlite"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/dedupe/dedupetest"
	"github.com/settle-go/settle/internal/testenv"
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
func TestSQLStore(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		for _, readBack := range []bool{false, true} {
			name := d.Name
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
					if db.Dialect == dedupe.SQLite {
						// SQLite locks the whole file: a case's transaction
						// held open on purpose (a zombie's, past its claim)
						// would hold every other case's writes past their
						// busy timeout. Each case gets a database of its own.
						return sqlHarness(t, d.Open(t), readBack)
					}
					return sqlHarness(t, db, readBack)
				})
			})
		}
	}
}

func TestSQLStoreAsksMariaDBForReturning(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t)
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: db.Dialect, Table: testenv.DedupeTable(t, db)})
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

func sqlHarness(t *testing.T, db testenv.DB, withoutReturning bool) dedupetest.Harness {
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: db.Dialect, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if withoutReturning {
		dedupe.WithoutReturning(store)
	}
	fx := newTxFixture(t, db, table)
	var levels []dedupetest.TxLevel
	for _, lv := range isolationLevels(t, db) {
		levels = append(levels, dedupetest.TxLevel{Name: lv.name, Begin: func(ctx context.Context) (dedupetest.Tx, error) {
			tx, end, err := lv.begin(ctx)
			if err != nil {
				return dedupetest.Tx{}, err
			}
			t.Cleanup(func() { _ = tx.Rollback(); end() })
			if err := fx.snapshot(ctx, tx); err != nil {
				_ = tx.Rollback()
				end()
				return dedupetest.Tx{}, err
			}
			return dedupetest.Tx{
				Store:    store.WithTx(tx),
				Commit:   func() error { defer end(); return tx.Commit() },
				Rollback: func() error { defer end(); return tx.Rollback() },
				Effect:   func(ctx context.Context, key string) error { return fx.effect(ctx, tx, key) },
			}, nil
		}})
	}
	return dedupetest.Harness{
		Store: store,
		// Round trips to a server on a loaded machine take milliseconds, and
		// a renewal must land well within the claim's lifetime.
		ClaimTTL:  600 * time.Millisecond,
		TxLevels:  levels,
		TxAborted: txAborted,
		Effects:   fx.count,
	}
}

// level is an isolation level a user can set on a database, and how to
// begin a transaction at it; end is called once the transaction is over.
type level struct {
	name  string
	begin func(ctx context.Context) (tx *sql.Tx, end func(), err error)
}

// isolationLevels lists every isolation level db's database offers.
// PostgreSQL: READ COMMITTED, REPEATABLE READ, SERIALIZABLE (READ
// UNCOMMITTED is READ COMMITTED there). MySQL/MariaDB: all four, and
// REPEATABLE READ with MariaDB's innodb_snapshot_isolation (the default
// from MariaDB 11.6), under which a locking read of a row changed since the
// snapshot fails. SQLite has no levels: a transaction begun IMMEDIATE (as
// settle's sqlite:// URLs do) or DEFERRED (the driver's default) on a WAL
// database.
func isolationLevels(t *testing.T, db testenv.DB) []level {
	at := func(name string, iso sql.IsolationLevel) level {
		return level{name, func(ctx context.Context) (*sql.Tx, func(), error) {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: iso})
			return tx, func() {}, err
		}}
	}
	switch db.Dialect {
	case dedupe.Postgres:
		return []level{
			at("read-committed", sql.LevelReadCommitted),
			at("repeatable-read", sql.LevelRepeatableRead),
			at("serializable", sql.LevelSerializable),
		}
	case dedupe.MySQL:
		levels := []level{
			at("read-uncommitted", sql.LevelReadUncommitted),
			at("read-committed", sql.LevelReadCommitted),
			at("repeatable-read", sql.LevelRepeatableRead),
			at("serializable", sql.LevelSerializable),
		}
		var name, value string
		if err := db.QueryRowContext(t.Context(), "SHOW VARIABLES LIKE 'innodb_snapshot_isolation'").Scan(&name, &value); err == nil {
			levels = append(levels, level{"repeatable-read-snapshot-isolation", func(ctx context.Context) (*sql.Tx, func(), error) {
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
	return []level{
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

func newTxFixture(t *testing.T, db testenv.DB, table string) *txFixture {
	fx := &txFixture{db: db, table: table, effects: testenv.Name(t, "ef")}
	if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+fx.effects+" (k VARCHAR(255) NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+fx.effects) })
	return fx
}

func (fx *txFixture) q(query string) string {
	if fx.db.Dialect == dedupe.Postgres {
		return strings.ReplaceAll(query, "?", "$1")
	}
	return query
}

// snapshot reads the claims table in tx, as a handler that reads before it
// confirms does: from here on, at REPEATABLE READ and above, tx reads a
// snapshot.
func (fx *txFixture) snapshot(ctx context.Context, tx interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) error {
	q := "SELECT COUNT(*) FROM " + `"` + fx.table + `"`
	if fx.db.Dialect == dedupe.MySQL {
		q = "SELECT COUNT(*) FROM `" + fx.table + "`"
	}
	return tx.QueryRowContext(ctx, q).Scan(new(int))
}

func (fx *txFixture) effect(ctx context.Context, tx *sql.Tx, key string) error {
	_, err := tx.ExecContext(ctx, fx.q("INSERT INTO "+fx.effects+" (k) VALUES (?)"), key)
	return err
}

func (fx *txFixture) count(ctx context.Context, key string) (int, error) {
	var n int
	err := fx.db.QueryRowContext(ctx, fx.q("SELECT COUNT(*) FROM "+fx.effects+" WHERE k = ?"), key).Scan(&n)
	return n, err
}

// The pgx store runs the same statements through pgx, on a pool whose
// connections the concurrent tests spread over.
func TestPgxStore(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	pool := testenv.PgxPool(t)
	dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
		return pgxHarness(t, db, pool)
	})
}

func pgxHarness(t *testing.T, db testenv.DB, pool *pgxpool.Pool) dedupetest.Harness {
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewPgxStore(pool, dedupe.PgxConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	fx := newTxFixture(t, db, table)
	var levels []dedupetest.TxLevel
	for _, lv := range []struct {
		name string
		iso  pgx.TxIsoLevel
	}{{"read-committed", pgx.ReadCommitted}, {"repeatable-read", pgx.RepeatableRead}, {"serializable", pgx.Serializable}} {
		levels = append(levels, dedupetest.TxLevel{Name: lv.name, Begin: func(ctx context.Context) (dedupetest.Tx, error) {
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: lv.iso})
			if err != nil {
				return dedupetest.Tx{}, err
			}
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			if err := tx.QueryRow(ctx, `SELECT COUNT(*) FROM "`+table+`"`).Scan(new(int)); err != nil {
				_ = tx.Rollback(ctx)
				return dedupetest.Tx{}, err
			}
			return dedupetest.Tx{
				Store:    store.WithTx(tx),
				Commit:   func() error { return tx.Commit(ctx) },
				Rollback: func() error { return tx.Rollback(ctx) },
				Effect: func(ctx context.Context, key string) error {
					_, err := tx.Exec(ctx, "INSERT INTO "+fx.effects+" (k) VALUES ($1)", key)
					return err
				},
			}, nil
		}})
	}
	return dedupetest.Harness{
		Store:     store,
		ClaimTTL:  600 * time.Millisecond,
		TxLevels:  levels,
		TxAborted: txAborted,
		Effects:   fx.count,
	}
}
