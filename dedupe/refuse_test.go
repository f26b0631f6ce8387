package dedupe_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// Refuse turns a key that ClaimConfirmed took in a transaction into a
// refused one: committed, every later claim of it is Refused, in a
// transaction (ClaimConfirmed, ClaimConfirmedAll) or not (Claim), and never
// taken over; rolled back, it leaves nothing. It acts only on the
// transaction's own confirmed key, and only in a transaction. Prune deletes
// a refused key as a confirmed one. On every database and driver, and on
// partitioned tables.
func TestRefuse(t *testing.T) {
	t.Parallel()
	backends := txBackends()
	for _, db := range partitionedDBs(t) {
		backends = append(backends, txBackend{"partitioned-" + string(db.Dialect), func(t *testing.T) (txStore, func(t *testing.T) openTx) {
			store := partitionedStore(t, db)
			// Claims in a caller's transaction make no partition.
			if err := store.AddPartitions(t.Context(), time.Now(), time.Now().Add(aheadSpan)); err != nil {
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
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			store, begin := b.open(t)
			ctx := t.Context()
			refuse := func(key string, commit bool) {
				t.Helper()
				tx := begin(t)
				defer tx.rollback()
				c, err := tx.store.ClaimConfirmed(ctx, key)
				if err != nil || c.Result != dedupe.Acquired {
					t.Fatalf("ClaimConfirmed(%s) = %+v, %v; want acquired", key, c, err)
				}
				if err := tx.store.Refuse(ctx, key); err != nil {
					t.Fatalf("Refuse(%s): %v", key, err)
				}
				if commit {
					if err := tx.commit(); err != nil {
						t.Fatal(err)
					}
				}
			}
			refuse("r1", true)
			refuse("r2", false)

			tx := begin(t)
			c, err := tx.store.ClaimConfirmed(ctx, "r1")
			if err != nil || c.Result != dedupe.Refused {
				t.Fatalf("ClaimConfirmed of a refused key = %+v, %v; want refused", c, err)
			}
			all, err := tx.store.ClaimConfirmedAll(ctx, []string{"r0", "r1"})
			if err != nil || len(all) != 2 || all[0].Result != dedupe.Acquired || all[1].Result != dedupe.Refused {
				t.Fatalf("ClaimConfirmedAll(r0, r1) = %+v, %v; want acquired, refused", all, err)
			}
			if err := tx.store.Refuse(ctx, "r9"); !errors.Is(err, dedupe.ErrClaimLost) {
				t.Fatalf("Refuse of a key the transaction did not claim = %v; want ErrClaimLost", err)
			}
			tx.rollback()

			if c, err := store.Claim(ctx, "r1", time.Minute); err != nil || c.Result != dedupe.Refused {
				t.Fatalf("Claim of a refused key = %+v, %v; want refused", c, err)
			}
			if st, found, err := store.Lookup(ctx, "", "r1"); err != nil || !found || st.State != "refused" {
				t.Fatalf("Lookup(r1) = %+v, %v, %v; want refused", st, found, err)
			}
			// Rolled back, the refusal left nothing: the key is taken.
			if c, err := store.Claim(ctx, "r2", time.Minute); err != nil || c.Result != dedupe.Acquired || c.Attempt != 1 {
				t.Fatalf("Claim of r2, whose refusal rolled back = %+v, %v; want acquired, attempt 1", c, err)
			}
			if err := store.Refuse(ctx, "r2"); err == nil {
				t.Fatal("Refuse outside a transaction succeeded")
			}
			if _, err := store.Prune(ctx, time.Now().Add(time.Hour)); err != nil {
				t.Fatal(err)
			}
			if _, found, err := store.Lookup(context.Background(), "", "r1"); err != nil || found {
				t.Fatalf("after Prune, Lookup(r1) found %v, %v; want the refused key pruned", found, err)
			}
		})
	}
}
