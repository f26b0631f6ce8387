package dedupe_test

import (
	"context"
	"database/sql"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// syncTracer records, for each statement pgx sends, whether it sets
// synchronous_commit, and what SHOW synchronous_commit answered.
type syncTracer struct {
	mu    sync.Mutex
	lease int // statements that turn synchronous_commit off
	other int // claims (INSERT) that do not
}

func (c *syncTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if !strings.HasPrefix(d.SQL, "INSERT INTO") {
		return ctx
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if strings.Contains(d.SQL, "'synchronous_commit', 'off'") {
		c.lease++
	} else {
		c.other++
	}
	return ctx
}

func (c *syncTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *syncTracer) counts() (lease, other int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lease, c.other
}

// tracedPostgres is a database/sql pool on PostgreSQL whose statements t
// sees.
func tracedPostgres(t *testing.T, tr pgx.QueryTracer) testenv.DB {
	cfg, err := pgx.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Tracer = tr
	db := testenv.Postgres(t)
	db.DB = stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.DB.Close() })
	return db
}

// With ConfirmInTx the middleware's claim on PostgreSQL commits without
// waiting for the disk, and the handler's confirmation in its transaction
// still makes the key a duplicate; without it every claim waits.
func TestConfirmInTxClaimsALease(t *testing.T) {
	t.Parallel()
	for _, confirmInTx := range []bool{false, true} {
		name := "plain"
		if confirmInTx {
			name = "confirm-in-tx"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tr := &syncTracer{}
			db := tracedPostgres(t, tr)
			drv := db.Driver()
			table := testenv.DedupeTable(t, db)
			store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			fx := newTxFixture(t, db, table)
			mw := newMiddleware(t, dedupe.Config{Store: store, ConfirmInTx: confirmInTx})
			runs := 0
			h := mw(func(msg *message.Message) ([]*message.Message, error) {
				runs++
				ctx := msg.Context()
				tx, err := drv.Begin(ctx, nil, "")
				if err != nil {
					return nil, err
				}
				defer func() { _ = drv.Rollback(context.Background(), tx) }()
				if err := fx.effect(ctx, drv.Tx(tx), msg.UUID); err != nil {
					return nil, err
				}
				if err := dedupe.ConfirmTx(ctx, tx); err != nil {
					return nil, err
				}
				return nil, drv.Commit(ctx, tx)
			})
			for range 3 {
				if _, err := h(newMsg(t, "lease-1")); err != nil {
					t.Fatal(err)
				}
			}
			n, err := fx.count(t.Context(), "lease-1")
			if err != nil {
				t.Fatal(err)
			}
			if runs != 1 || n != 1 {
				t.Fatalf("%d runs, %d effects; want one of each", runs, n)
			}
			lease, other := tr.counts()
			// The first delivery's claim writes the key; the two
			// duplicates' claims write nothing (no row returned).
			if confirmInTx && (lease != 3 || other != 1) || !confirmInTx && lease != 0 {
				t.Fatalf("claims sent as leases: %d, other INSERTs: %d (the effect's is one)", lease, other)
			}
		})
	}
}

// A lease claim's statement turns synchronous_commit off for its own
// transaction, and only there; a claim in a caller's transaction
// (WithTx) never does, whatever the context says.
func TestLeaseClaimSetsSynchronousCommitForItsTransactionOnly(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	drv := sqldb.Std(db.DB, sqldb.Postgres)
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	ctx := dedupe.AsLease(t.Context())
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	setting := func(q interface {
		QueryRowContext(context.Context, string, ...any) *sql.Row
	}) string {
		var v string
		if err := q.QueryRowContext(ctx, "SHOW synchronous_commit").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}

	// In a caller's transaction the claim commits with it, as usual.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	c, err := store.WithTx(tx).Claim(ctx, "in-tx", time.Minute)
	if err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("claim in tx = %+v, %v", c, err)
	}
	if v := setting(tx); v != "on" {
		t.Fatalf("synchronous_commit in the caller's transaction after a lease claim = %q, want on", v)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}

	// On the pool the claim is a transaction of its own, which the setting
	// does not outlive.
	c, err = store.Claim(ctx, "leased", time.Minute)
	if err != nil || c.Result != dedupe.Acquired || c.Attempt != 1 {
		t.Fatalf("lease claim = %+v, %v; want acquired on attempt 1", c, err)
	}
	for range 3 { // the pool's connections, the claim's among them
		if v := setting(db); v != "on" {
			t.Fatalf("synchronous_commit after a lease claim = %q, want on", v)
		}
	}
	if c, err := store.Claim(ctx, "leased", time.Minute); err != nil || c.Result != dedupe.Busy {
		t.Fatalf("second claim = %+v, %v; want busy", c, err)
	}

	// Inside an explicit transaction the statement is seen to set it (the
	// statement of a claim sent as a lease, run where its effect shows).
	tx, err = db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	var attempts, expires, first int64
	var sync string
	if err := tx.QueryRowContext(ctx, dedupe.LeaseQuery(store), []byte("shown"), "tok", int64(time.Minute/time.Microsecond)).Scan(&attempts, &expires, &first, &sync); err != nil {
		t.Fatal(err)
	}
	if v := setting(tx); v != "off" || sync != "off" {
		t.Fatalf("synchronous_commit after the lease statement = %q (returned %q), want off", v, sync)
	}
}
