// Package testenv gives tests the real services they need, read from the
// environment:
//
//	SETTLE_POSTGRES_URL  postgres://postgres@127.0.0.1:5432/test?sslmode=disable
//	SETTLE_MYSQL_URL     mysql://root@127.0.0.1:3306/test
//	SETTLE_AMQP_URL      amqp://guest:guest@127.0.0.1:5672/
//	SETTLE_NATS_URL      nats://127.0.0.1:4222 (with JetStream)
//	SETTLE_REDIS_URL     redis://127.0.0.1:6379/0
//
// A test whose variable is unset is skipped with a message naming it, unless
// SETTLE_REQUIRE_INTEGRATION=1, when it fails instead. A package's TestMain
// calls Main, which says after the tests which services they used and how
// many skipped for lack of which variable.
package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/sqldb"
)

// Environment variable names, the same as the examples' and the settle
// command's (internal/settleenv).
const (
	PostgresURLEnv = settleenv.PostgresURL
	MySQLURLEnv    = settleenv.MySQLURL
	AMQPURLEnv     = settleenv.AMQPURL
	NATSURLEnv     = settleenv.NATSURL
	RedisURLEnv    = settleenv.RedisURL
	RequireEnv     = settleenv.RequireIntegration
)

// Require returns the value of the environment variable name, or skips the
// test (fails it when SETTLE_REQUIRE_INTEGRATION=1).
func Require(t testing.TB, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v != "" {
		if s, ok := services[name]; ok {
			noteUsed(s)
		} else {
			noteUsed(name)
		}
		return v
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s is not set and %s=1: integration tests may not skip", name, RequireEnv)
	}
	noteSkipped(name)
	t.Skipf("set %s to run this test against a real service", name)
	return ""
}

// DB is an open database of one dialect.
type DB struct {
	*sql.DB
	Dialect sqldb.Dialect
}

// Postgres opens SETTLE_POSTGRES_URL and checks that it answers.
func Postgres(t testing.TB) DB { return open(t, Require(t, PostgresURLEnv)) }

// MySQL opens SETTLE_MYSQL_URL and checks that it answers.
func MySQL(t testing.TB) DB { return open(t, Require(t, MySQLURLEnv)) }

// SQLite opens a new SQLite file in the test's temporary directory.
func SQLite(t testing.TB) DB {
	noteUsed("SQLite")
	return open(t, "sqlite://"+filepath.Join(t.TempDir(), "settle.db"))
}

// MySQLFoundRows opens SETTLE_MYSQL_URL with the go-sql-driver option
// clientFoundRows=true, under which an UPDATE reports the rows it matched
// rather than the rows it changed. Users set it; stores must not care.
func MySQLFoundRows(t testing.TB) DB {
	u := Require(t, MySQLURLEnv)
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return open(t, u+sep+"clientFoundRows=true")
}

// AMQPURL returns SETTLE_AMQP_URL.
func AMQPURL(t testing.TB) string { return Require(t, AMQPURLEnv) }

// NATSURL returns SETTLE_NATS_URL (a NATS server with JetStream).
func NATSURL(t testing.TB) string { return Require(t, NATSURLEnv) }

// RedisURL returns SETTLE_REDIS_URL.
func RedisURL(t testing.TB) string { return Require(t, RedisURLEnv) }

// Databases returns every database this run can reach: SQLite always, and
// PostgreSQL and MySQL when configured, MySQL both with and without the
// clientFoundRows DSN option. Unconfigured ones become skipped (or
// failed) subtests through Require when the caller runs them.
func Databases() []struct {
	Name string
	Open func(testing.TB) DB
} {
	return []struct {
		Name string
		Open func(testing.TB) DB
	}{
		{"sqlite", SQLite},
		{"postgres", Postgres},
		{"mysql", MySQL},
		{"mysql-foundrows", MySQLFoundRows},
	}
}

func open(t testing.TB, u string) DB {
	t.Helper()
	db, dialect, err := sqlurl.Open(u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := db.PingContext(t.Context()); err != nil {
		t.Fatalf("%s database is not reachable: %v", dialect, err)
	}
	return DB{DB: db, Dialect: dialect}
}

var nonIdent = regexp.MustCompile(`[^a-z0-9_]+`)

// Name returns a unique identifier for a table, queue or topic of this test:
// prefix, a slug of the test name and a random suffix, at most 60 bytes.
func Name(t testing.TB, prefix string) string {
	slug := nonIdent.ReplaceAllString(strings.ToLower(t.Name()), "_")
	var b [4]byte
	_, _ = rand.Read(b[:])
	suffix := "_" + hex.EncodeToString(b[:])
	name := prefix + "_" + slug
	if max := 60 - len(suffix); len(name) > max {
		name = name[:max]
	}
	return name + suffix
}

// Driver is db as a sqldb.Driver of database/sql.
func (db DB) Driver() sqldb.Driver[*sql.Tx] { return sqldb.Std(db.DB, db.Dialect) }

// DedupeTable creates a claims table with a unique name in db and drops it
// when the test ends.
func DedupeTable(t testing.TB, db DB) string {
	t.Helper()
	table := Name(t, "dd")
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	CreateTable(t, db, table, store.Schema())
	return table
}

// CreateTable runs ddl, the statements that create table, in db and drops
// the table when the test ends.
func CreateTable(t testing.TB, db DB, table string, ddl []string) {
	t.Helper()
	for _, s := range ddl {
		if _, err := db.ExecContext(t.Context(), s); err != nil {
			t.Fatalf("create %s: %v", table, err)
		}
	}
	t.Cleanup(func() {
		q := `DROP TABLE IF EXISTS "` + table + `"`
		if db.Dialect == sqldb.MySQL {
			q = "DROP TABLE IF EXISTS `" + table + "`"
		}
		_, _ = db.ExecContext(context.Background(), q)
	})
}
