package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// db is one database under one driver, for the tests that run the same
// case on every driver: a database/sql PostgreSQL, MySQL/MariaDB (with and
// without clientFoundRows) and SQLite, and pgx on PostgreSQL. sql is the
// same database through database/sql, for a test's own checks and DDL.
type db[TTx any] struct {
	sqldb.Driver[TTx]
	sql testenv.DB
	// inUse is how many connections of the driver's pool are in use.
	inUse func() int
}

// ph is the n-th placeholder of the database's dialect.
func (d db[TTx]) ph(n int) string {
	if d.Dialect() == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

// quote quotes a table name for the database's dialect.
func (d db[TTx]) quote(s string) string {
	if d.Dialect() == sqldb.MySQL {
		return "`" + s + "`"
	}
	return `"` + s + `"`
}

// exec runs a statement of the test's own on the database (DDL, setup).
func (d db[TTx]) exec(t testing.TB, query string, args ...any) {
	t.Helper()
	if _, err := d.sql.ExecContext(t.Context(), query, args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// count is the number of rows a COUNT query of the test's returns.
func (d db[TTx]) count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := d.sql.QueryRowContext(t.Context(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// claimsTable creates a claims table of a unique name and its store, and
// drops the table when the test ends.
func claimsTable[TTx any](t testing.TB, d db[TTx]) *dedupe.SQLStore[TTx] {
	s, _ := claimsTableNamed(t, d)
	return s
}

// claimsTableNamed is claimsTable, with the table's name.
func claimsTableNamed[TTx any](t testing.TB, d db[TTx]) (*dedupe.SQLStore[TTx], string) {
	t.Helper()
	table := testenv.Name(t, "dd")
	store, err := dedupe.NewSQLStore(d.Driver, dedupe.SQLConfig{Table: table})
	must(t, err)
	for _, s := range store.Schema() {
		d.exec(t, s)
	}
	t.Cleanup(func() { _, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+d.quote(table)) })
	return store, table
}

// stdOf is a database/sql database as a db.
func stdOf(d testenv.DB) db[*sql.Tx] {
	return db[*sql.Tx]{Driver: sqldb.Std(d.DB, sqldb.Dialect(d.Dialect)), sql: d, inUse: func() int { return d.Stats().InUse }}
}

// pgxDB is PostgreSQL through a pgx pool.
func pgxDB(t testing.TB) db[pgx.Tx] {
	pool := testenv.PgxPool(t)
	return db[pgx.Tx]{Driver: sqldb.Pgx(pool), sql: testenv.Postgres(t), inUse: func() int { return int(pool.Stat().AcquiredConns()) }}
}

// onEachDriver runs a test case on every database and driver, in parallel
// subtests: the case is one generic function, instantiated for each
// driver's transaction type (onEachDriver(t, caseX[*sql.Tx],
// caseX[pgx.Tx])).
func onEachDriver(t *testing.T, std func(*testing.T, db[*sql.Tx]), pgxCase func(*testing.T, db[pgx.Tx])) {
	t.Helper()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			std(t, stdOf(d.Open(t)))
		})
	}
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		pgxCase(t, pgxDB(t))
	})
}

// onServers is onEachDriver without SQLite, for cases about a server's
// sessions (concurrency, lost connections, deferred constraints).
func onServers(t *testing.T, std func(*testing.T, db[*sql.Tx]), pgxCase func(*testing.T, db[pgx.Tx])) {
	t.Helper()
	for _, d := range testenv.Databases() {
		if d.Name == "sqlite" {
			continue
		}
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			std(t, stdOf(d.Open(t)))
		})
	}
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		pgxCase(t, pgxDB(t))
	})
}

// onPostgres runs a case on PostgreSQL through both drivers.
func onPostgres(t *testing.T, std func(*testing.T, db[*sql.Tx]), pgxCase func(*testing.T, db[pgx.Tx])) {
	t.Helper()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		std(t, stdOf(testenv.Postgres(t)))
	})
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		pgxCase(t, pgxDB(t))
	})
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// std is a database/sql database's Driver.
func std(d testenv.DB) sqldb.Driver[*sql.Tx] { return sqldb.Std(d.DB, sqldb.Dialect(d.Dialect)) }

// stmtFunc is a test handler's work in its transaction, through the
// transaction's executor: the same code whatever the driver.
type stmtFunc func(ctx context.Context, ex sqldb.Executor, msg *message.Message) error

// txHandlerOn is a transactional handler on d with cfg (DB and Store set
// here: the store of the claims table claims) whose function runs fn, and
// its store.
func txHandlerOn[TTx any](t testing.TB, d sqldb.Driver[TTx], claims string, cfg pipeline.TxConfig[TTx], fn stmtFunc) (message.NoPublishHandlerFunc, dedupe.Store) {
	t.Helper()
	store, err := dedupe.NewSQLStore(d, dedupe.SQLConfig{Table: claims})
	must(t, err)
	cfg.DB, cfg.Store = d, store
	h, err := pipeline.NewTxHandler(cfg, func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
		return fn(ctx, d.Tx(tx), msg)
	})
	must(t, err)
	return h, store
}

// quote quotes a table name for db's dialect.
func quote(db testenv.DB, s string) string { return stdOf(db).quote(s) }
