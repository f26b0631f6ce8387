package dedupe_test

import (
	"errors"
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

// ClaimConfirmedAll settles a batch of keys in one statement: new and
// released keys are taken, confirmed ones are duplicates, live claims busy,
// all in the order given; a rollback leaves no trace.
func TestClaimConfirmedAll(t *testing.T) {
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
			done, _ := store.Claim(ctx, "done", time.Minute)
			released, _ := store.Claim(ctx, "released", time.Minute)
			store.Claim(ctx, "held", time.Minute)
			if err := errors.Join(store.Confirm(ctx, done), store.Release(ctx, released)); err != nil {
				t.Fatal(err)
			}
			keys := []string{"new-1", "done", "held", "released", "new-2"}
			run := func(commit bool) []dedupe.Claim {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				cs, err := store.WithTx(tx).ClaimConfirmedAll(ctx, keys)
				if err != nil {
					t.Fatal(err)
				}
				if commit {
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				}
				return cs
			}
			want := []dedupe.Result{dedupe.Acquired, dedupe.Duplicate, dedupe.Busy, dedupe.Acquired, dedupe.Acquired}
			check := func(cs []dedupe.Claim, want []dedupe.Result, attempts []int) {
				t.Helper()
				for i, c := range cs {
					if c.Key != keys[i] || c.Result != want[i] || c.Attempt != attempts[i] {
						t.Errorf("%s: %v attempt %d, want %v attempt %d", keys[i], c.Result, c.Attempt, want[i], attempts[i])
					}
				}
			}
			check(run(false), want, []int{1, 1, 1, 2, 1})
			// Rolled back: the same again.
			check(run(true), want, []int{1, 1, 1, 2, 1})
			// Committed: every key taken is a duplicate now.
			check(run(true), []dedupe.Result{dedupe.Duplicate, dedupe.Duplicate, dedupe.Busy, dedupe.Duplicate, dedupe.Duplicate}, []int{1, 1, 1, 2, 1})
			if _, err := store.ClaimConfirmedAll(ctx, []string{"a", "a"}); err == nil {
				t.Fatal("a key given twice was accepted")
			}
		})
	}
}
