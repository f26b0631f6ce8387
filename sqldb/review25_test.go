package sqldb_test

import (
	"context"
	"database/sql"
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
	"github.com/settle-go/settle/sqldb/sqldbtest"
)

// TestImportingSettleRegistersNoDriver builds a program that imports
// settle's packages and nothing else (testdata/nodrivers) and runs it: it
// prints sql.Drivers(), which must be empty. A driver registered by an
// import of settle is one the user did not ask for, and takes its name
// ("postgres", "mysql") from the driver the user does want.
func TestImportingSettleRegistersNoDriver(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	for _, c := range []struct{ name, tags string }{
		{"settle", ""},
		{"with-pipeline", "pipeline"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, err := exec.CommandContext(t.Context(), goBin, "run", "-tags="+c.tags, "./testdata/nodrivers").CombinedOutput()
			if err != nil {
				t.Fatalf("go run ./testdata/nodrivers: %v\n%s", err, out)
			}
			if drivers := strings.Fields(string(out)); len(drivers) > 0 {
				t.Fatalf("importing settle registered the database/sql drivers %q; want none (go list -deps shows who brings them)", drivers)
			}
		})
	}
}

// TestReview25ConformanceUnderDSNOptions runs the driver suite with the
// DSN options users set: MariaDB interpolateParams, parseTime and
// clientFoundRows; pgx's simple protocol and no statement cache, through
// database/sql and through pgx.
func TestReview25ConformanceUnderDSNOptions(t *testing.T) {
	for _, c := range []struct{ name, env, opts string }{
		{"std-mysql-interpolate-parsetime-foundrows", testenv.MySQLURLEnv, "interpolateParams=true&parseTime=true&clientFoundRows=true"},
		{"std-postgres-simple-protocol", testenv.PostgresURLEnv, "default_query_exec_mode=simple_protocol"},
		{"std-postgres-no-statement-cache", testenv.PostgresURLEnv, "default_query_exec_mode=describe_exec&statement_cache_capacity=0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sqldbtest.Run(t, func(t *testing.T) sqldb.Driver[*sql.Tx] {
				db, d, err := sqlurl.Open(withOpts(testenv.Require(t, c.env), c.opts))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = db.Close() })
				return sqldb.Std(db, d)
			})
		})
	}
	for _, c := range []struct{ name, opts string }{
		{"pgx-postgres-simple-protocol", "default_query_exec_mode=simple_protocol"},
		{"pgx-postgres-no-statement-cache", "default_query_exec_mode=describe_exec&statement_cache_capacity=0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sqldbtest.Run(t, func(t *testing.T) sqldb.Driver[pgx.Tx] {
				pool, err := pgxpool.New(context.Background(), withOpts(testenv.Require(t, testenv.PostgresURLEnv), c.opts))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				return sqldb.Pgx(pool)
			})
		})
	}
}

func withOpts(u, opts string) string {
	if strings.Contains(u, "?") {
		return u + "&" + opts
	}
	return u + "?" + opts
}

// Std(nil, d) is the driver of a tool that only prints DDL (the docs of
// dedupe.SQLStore.Schema say so). A statement on it is an error saying
// what is wrong, not a nil-pointer panic in database/sql; the same for
// Pgx(nil).
func TestReview25NilPoolIsAnError(t *testing.T) {
	for _, c := range []struct {
		name string
		run  func() error
	}{
		{"std-exec", func() error { _, err := sqldb.Std(nil, sqldb.Postgres).DB().Exec(t.Context(), "SELECT 1"); return err }},
		{"std-queryrow", func() error {
			return sqldb.Std(nil, sqldb.MySQL).DB().QueryRow(t.Context(), "SELECT 1", nil, new(int))
		}},
		{"std-begin", func() error { _, err := sqldb.Std(nil, sqldb.SQLite).Begin(t.Context(), nil, ""); return err }},
		{"std-listen", func() error { return sqldb.Std(nil, sqldb.Postgres).Listen(t.Context(), `"x"`, func() {}, 0, nil) }},
		{"std-maxconns", func() error { _ = sqldb.Std(nil, sqldb.Postgres).MaxConns(); return errors.New("no panic") }},
		{"pgx-exec", func() error { _, err := sqldb.Pgx(nil).DB().Exec(t.Context(), "SELECT 1"); return err }},
		{"pgx-begin", func() error { _, err := sqldb.Pgx(nil).Begin(t.Context(), nil, ""); return err }},
		{"pgx-maxconns", func() error { _ = sqldb.Pgx(nil).MaxConns(); return errors.New("no panic") }},
	} {
		t.Run(c.name, func(t *testing.T) {
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Errorf("panic: %v", p)
					}
				}()
				err = c.run()
			}()
			if err == nil {
				t.Error("no error on a nil pool")
			}
		})
	}
}

// Std with a dialect that is not its database's: the statements settle
// writes for one dialect can half-work on another (SQLite reads
// PostgreSQL's quoting and types, so a store's Check passes and every claim
// then fails). A driver settle knows (pgx's stdlib, go-sql-driver/mysql,
// modernc.org/sqlite) under the wrong dialect is refused at the first
// statement, naming both.
func TestReview25StdRefusesTheWrongDialect(t *testing.T) {
	sqlite := testenv.SQLite(t)
	for _, c := range []struct {
		name string
		db   *sql.DB
		d    sqldb.Dialect
	}{
		{"sqlite-as-postgres", sqlite.DB, sqldb.Postgres},
		{"sqlite-as-mysql", sqlite.DB, sqldb.MySQL},
		{"postgres-as-sqlite", testenv.Postgres(t).DB, sqldb.SQLite},
		{"mysql-as-postgres", testenv.MySQL(t).DB, sqldb.Postgres},
	} {
		t.Run(c.name, func(t *testing.T) {
			drv := sqldb.Std(c.db, c.d)
			_, err := drv.DB().Exec(t.Context(), "SELECT 1")
			if err == nil || !strings.Contains(err.Error(), string(c.d)) {
				t.Fatalf("a statement on Std(db, %s) of another database: %v; want an error naming the dialect", c.d, err)
			}
			if _, err := drv.Begin(t.Context(), nil, ""); err == nil {
				t.Fatal("Begin on the wrong dialect succeeded")
			}
		})
	}
	// The right dialect, and a driver settle does not know, still work.
	if _, err := sqldb.Std(sqlite.DB, sqldb.SQLite).DB().Exec(t.Context(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
}
