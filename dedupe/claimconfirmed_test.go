package dedupe_test

import (
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// ClaimConfirmed, the one-statement claim of transactional handlers: final
// on commit, gone on rollback, and it respects other claims.
func TestClaimConfirmed(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: db.Dialect, Table: testenv.DedupeTable(t, db)})
			if err != nil {
				t.Fatal(err)
			}
			ctx := t.Context()
			inTx := func(key string, commit bool) dedupe.Result {
				t.Helper()
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				c, err := store.WithTx(tx).ClaimConfirmed(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				if commit {
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				}
				return c.Result
			}
			if r := inTx("k1", false); r != dedupe.Acquired {
				t.Fatalf("first = %v", r)
			}
			if c, err := store.Claim(ctx, "k1", time.Minute); err != nil || c.Result != dedupe.Acquired || c.Attempt != 1 {
				t.Fatalf("after rollback Claim = %+v, %v; want no trace of it", c, err)
			}
			if r := inTx("k2", true); r != dedupe.Acquired {
				t.Fatalf("k2 = %v", r)
			}
			if r := inTx("k2", true); r != dedupe.Duplicate {
				t.Fatalf("k2 again = %v, want duplicate", r)
			}
			if c, err := store.Claim(ctx, "k2", time.Minute); err != nil || c.Result != dedupe.Duplicate {
				t.Fatalf("Claim of k2 = %+v, %v; want duplicate", c, err)
			}
			// A released key is taken and confirmed; a live claim is busy.
			c, _ := store.Claim(ctx, "k3", time.Minute)
			if err := store.Release(ctx, c); err != nil {
				t.Fatal(err)
			}
			if r := inTx("k3", true); r != dedupe.Acquired {
				t.Fatalf("released k3 = %v, want acquired", r)
			}
			if d, _ := store.Claim(ctx, "k3", time.Minute); d.Result != dedupe.Duplicate || d.Attempt != 2 {
				t.Fatalf("k3 after = %+v; want duplicate after 2 attempts", d)
			}
			if _, err := store.Claim(ctx, "k4", time.Minute); err != nil {
				t.Fatal(err)
			}
			if r := inTx("k4", false); r != dedupe.Busy {
				t.Fatalf("k4 held by a live claim = %v, want busy", r)
			}
		})
	}
}
