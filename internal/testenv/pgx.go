package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/sqldb"
)

// PgxPool opens a pgx pool on SETTLE_POSTGRES_URL, checks that it answers
// and closes it when the test ends.
func PgxPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	u := Require(t, PostgresURLEnv)
	pool, err := pgxpool.New(context.Background(), u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Close waits for every acquired connection: a test that leaked
		// one (a transaction never ended) would hang here to the test
		// binary's timeout instead of failing.
		closed := make(chan struct{})
		go func() { pool.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Errorf("pgx pool: %d connections still acquired 10s after the test: a connection or a transaction was leaked", pool.Stat().AcquiredConns())
		}
	})
	if err := pool.Ping(t.Context()); err != nil {
		t.Fatalf("postgres is not reachable through pgx: %v", err)
	}
	return pool
}

// Pgx is a pgx pool on SETTLE_POSTGRES_URL (see PgxPool) as a sqldb.Driver.
func Pgx(t testing.TB) sqldb.Driver[pgx.Tx] { return sqldb.Pgx(PgxPool(t)) }
