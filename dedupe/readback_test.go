package dedupe_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// A batch redelivered whole (every key confirmed already, after a crash
// between commit and acks) costs ClaimConfirmedAll on pgx its one statement
// and one pipelined read back of the keys it did not take: two round trips,
// whatever the batch's size, and no statement per key.
func TestClaimConfirmedAllReadsBackInOneRoundTripOnPgx(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	var tr countTracer
	cfg, err := pgxpool.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = &tr
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	drv := sqldb.Pgx(pool)
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	keys := []string{"a", "b", "c", "d", "e"}
	held, err := store.Claim(ctx, "e", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.ClaimConfirmedAll(ctx, keys[:4]); err != nil {
		t.Fatal(err)
	}
	tx, err := drv.Begin(ctx, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = drv.Rollback(context.Background(), tx) }()
	tr.queries.Store(0)
	tr.batches.Store(0)
	cs, err := store.WithTx(tx).ClaimConfirmedAll(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cs {
		want := dedupe.Duplicate
		if c.Key == held.Key {
			want = dedupe.Busy
		}
		if c.Key != keys[i] || c.Result != want || c.Attempt != 1 {
			t.Errorf("%s: %v attempt %d, want %v attempt 1", keys[i], c.Result, c.Attempt, want)
		}
	}
	if q, b := tr.queries.Load(), tr.batches.Load(); q != 1 || b != 1 {
		t.Fatalf("ClaimConfirmedAll of a batch already settled sent %d statements and %d batches; want 1 and 1", q, b)
	}
}

// countTracer counts the statements (outside batches) and the batches a
// pgx connection sends.
type countTracer struct{ queries, batches atomic.Int64 }

func (c *countTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}

func (c *countTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *countTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.batches.Add(1)
	return ctx
}

func (c *countTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *countTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
