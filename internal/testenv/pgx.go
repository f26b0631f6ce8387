package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
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
	t.Cleanup(pool.Close)
	if err := pool.Ping(t.Context()); err != nil {
		t.Fatalf("postgres is not reachable through pgx: %v", err)
	}
	return pool
}
