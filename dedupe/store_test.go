package dedupe_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

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
	return dedupetest.Harness{
		Store: store,
		// Round trips to a server on a loaded machine take milliseconds, and
		// a renewal must land well within the claim's lifetime.
		ClaimTTL: 600 * time.Millisecond,
		BeginTx: func(ctx context.Context) (dedupetest.Tx, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return dedupetest.Tx{}, err
			}
			t.Cleanup(func() { _ = tx.Rollback() })
			return dedupetest.Tx{Store: store.WithTx(tx), Commit: tx.Commit, Rollback: tx.Rollback}, nil
		},
	}
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
	return dedupetest.Harness{
		Store:    store,
		ClaimTTL: 600 * time.Millisecond,
		BeginTx: func(ctx context.Context) (dedupetest.Tx, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return dedupetest.Tx{}, err
			}
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			return dedupetest.Tx{
				Store:    store.WithTx(tx),
				Commit:   func() error { return tx.Commit(ctx) },
				Rollback: func() error { return tx.Rollback(ctx) },
			}, nil
		},
	}
}
