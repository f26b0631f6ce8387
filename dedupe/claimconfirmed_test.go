package dedupe_test

import (
	"context"
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
	for _, b := range txBackends() {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			store, begin := b.open(t)
			ctx := t.Context()
			inTx := func(key string, commit bool) dedupe.Result {
				t.Helper()
				tx := begin(t)
				defer tx.rollback()
				c, err := tx.store.ClaimConfirmed(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				if commit {
					if err := tx.commit(); err != nil {
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
	for _, b := range txBackends() {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			store, begin := b.open(t)
			ctx := t.Context()
			done, _ := store.Claim(ctx, "done", time.Minute)
			released, _ := store.Claim(ctx, "released", time.Minute)
			store.Claim(ctx, "held", time.Minute)
			if err := errors.Join(store.Confirm(ctx, done), store.Release(ctx, released)); err != nil {
				t.Fatal(err)
			}
			keys := []string{"new-1", "done", "held", "released", "new-2"}
			run := func(commit bool) []dedupe.Claim {
				tx := begin(t)
				defer tx.rollback()
				cs, err := tx.store.ClaimConfirmedAll(ctx, keys)
				if err != nil {
					t.Fatal(err)
				}
				if commit {
					if err := tx.commit(); err != nil {
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

// txStore is what both SQL stores offer a transactional handler.
type txStore interface {
	dedupe.Store
	ClaimConfirmed(ctx context.Context, key string) (dedupe.Claim, error)
	ClaimConfirmedAll(ctx context.Context, keys []string) ([]dedupe.Claim, error)
	Refuse(ctx context.Context, key string) error
	Lookup(ctx context.Context, scope, key string) (dedupe.KeyState, bool, error)
}

// openTx is a store bound to a transaction rolled back by rollback unless
// committed.
type openTx struct {
	store    txStore
	commit   func() error
	rollback func()
}

type txBackend struct {
	name string
	open func(t *testing.T) (txStore, func(t *testing.T) openTx)
}

// txBackends are the databases of testenv.Databases through database/sql,
// and PostgreSQL through pgx.
func txBackends() []txBackend {
	var bs []txBackend
	for _, d := range testenv.Databases() {
		bs = append(bs, txBackend{d.Name, func(t *testing.T) (txStore, func(t *testing.T) openTx) {
			db := d.Open(t)
			store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
			if err != nil {
				t.Fatal(err)
			}
			return store, func(t *testing.T) openTx {
				tx, err := db.BeginTx(t.Context(), nil)
				if err != nil {
					t.Fatal(err)
				}
				return openTx{store.WithTx(tx), tx.Commit, func() { _ = tx.Rollback() }}
			}
		}})
	}
	return append(bs, txBackend{"postgres-pgx", func(t *testing.T) (txStore, func(t *testing.T) openTx) {
		db, drv := testenv.Postgres(t), testenv.Pgx(t)
		store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
		if err != nil {
			t.Fatal(err)
		}
		return store, func(t *testing.T) openTx {
			tx, err := drv.Begin(t.Context(), nil, "")
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			return openTx{store.WithTx(tx), func() error { return tx.Commit(ctx) }, func() { _ = tx.Rollback(ctx) }}
		}
	}})
}
