package dedupe_test

import (
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/dedupe/dedupetest"
	"github.com/settle-go/settle/internal/testenv"
)

// testPeriod is the partitions' period in the tests: short, so that the
// suite's runs, which last seconds, cross partition boundaries many times,
// and every write moves its row to another partition now and then.
const testPeriod = 2 * time.Second

// partitionedDBs are the databases with partitioned tables.
func partitionedDBs(t *testing.T) []testenv.DB {
	return []testenv.DB{testenv.Postgres(t), testenv.MySQL(t)}
}

// partitionedStore makes a partitioned claims table of its own on db.
func partitionedStore(t *testing.T, db testenv.DB) *dedupe.SQLStore[*sql.Tx] {
	t.Helper()
	table := testenv.Name(t, "dp")
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table, Partition: testPeriod})
	if err != nil {
		t.Fatal(err)
	}
	testenv.CreateTable(t, db, table, store.Schema())
	return store
}

// The conformance suite, linearizability and the prune races included, on
// a partitioned table with partitions of two seconds: the runs cross
// partition boundaries, rows move between partitions as they are written,
// and the pruners drop partitions whole under the claims. The suite's
// transaction cases are skipped: a partitioned table takes claims in
// transactions of its own only.
func TestSQLStorePartitioned(t *testing.T) {
	t.Parallel()
	for _, db := range partitionedDBs(t) {
		t.Run(string(db.Dialect), func(t *testing.T) {
			t.Parallel()
			dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
				s := partitionedStore(t, db)
				if err := s.Check(t.Context()); err != nil {
					t.Fatalf("Check of a partitioned table: %v", err)
				}
				return dedupetest.Harness{Store: s, ClaimTTL: 600 * time.Millisecond}
			})
		})
	}
}

// TestPartitionedClaimUniqueAcrossPartitions races first claims of a new
// key whose rows would go to different partitions: each worker claims with
// another lifetime, so its row's until_at (the claim's expiry) falls in
// another partition. The primary key (key, until_at) does not stop a
// second row, so only the claim's own rule can: exactly one worker may
// acquire each key, and a later claim from any side must see it.
func TestPartitionedClaimUniqueAcrossPartitions(t *testing.T) {
	t.Parallel()
	for _, db := range partitionedDBs(t) {
		t.Run(string(db.Dialect), func(t *testing.T) {
			t.Parallel()
			s := partitionedStore(t, db)
			const workers, rounds = 6, 40
			for round := range rounds {
				key := fmt.Sprintf("boundary-%d", round)
				var (
					wg    sync.WaitGroup
					mu    sync.Mutex
					won   []dedupe.Claim
					start = make(chan struct{})
				)
				for w := range workers {
					wg.Go(func() {
						<-start
						// 1s, 3s, 5s, ...: a partition of 2s each apart.
						c, err := s.Claim(t.Context(), key, time.Second+time.Duration(w)*testPeriod)
						if err != nil {
							t.Errorf("Claim: %v", err)
							return
						}
						if c.Result == dedupe.Acquired {
							mu.Lock()
							won = append(won, c)
							mu.Unlock()
						}
					})
				}
				close(start)
				wg.Wait()
				if len(won) != 1 {
					t.Fatalf("round %d: %d workers acquired %q at once, want 1: %+v", round, len(won), key, won)
				}
				if err := s.Confirm(t.Context(), won[0]); err != nil {
					t.Fatal(err)
				}
				if c, err := s.Claim(t.Context(), key, time.Minute); err != nil || c.Result != dedupe.Duplicate {
					t.Fatalf("round %d: claim after confirm = %v, %v, want duplicate", round, c.Result, err)
				}
			}
		})
	}
}

// TestPartitionedPruneDropsPartitions: keys confirmed in a period that is
// over are removed by dropping their partition (it is gone afterwards),
// while a key confirmed in the current period and a live claim stay.
func TestPartitionedPruneDropsPartitions(t *testing.T) {
	t.Parallel()
	for _, db := range partitionedDBs(t) {
		t.Run(string(db.Dialect), func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			s := partitionedStore(t, db)
			const old = 20
			for i := range old {
				c, err := s.Claim(ctx, fmt.Sprintf("old-%d", i), time.Minute)
				if err != nil || c.Result != dedupe.Acquired {
					t.Fatalf("Claim: %v, %v", c.Result, err)
				}
				if err := s.Confirm(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
			// Claimed with the old keys, live long after their period.
			live, err := s.Claim(ctx, "live", time.Minute)
			if err != nil || live.Result != dedupe.Acquired {
				t.Fatalf("Claim(live): %v, %v", live.Result, err)
			}
			before, err := dedupe.PartitionBuckets(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			// Past the end of the old keys' period, and one more, so that
			// the cutoff rounded down lies after it.
			time.Sleep(2*testPeriod + 100*time.Millisecond)
			recent, err := s.Claim(ctx, "recent", time.Minute)
			if err != nil || recent.Result != dedupe.Acquired {
				t.Fatalf("Claim(recent): %v, %v", recent.Result, err)
			}
			if err := s.Confirm(ctx, recent); err != nil {
				t.Fatal(err)
			}
			n, err := s.Prune(ctx, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if n != old {
				t.Fatalf("Prune removed %d keys, want the %d old ones", n, old)
			}
			after, err := dedupe.PartitionBuckets(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			gone := 0
			for _, b := range before {
				if !slices.Contains(after, b) {
					gone++
				}
			}
			if gone == 0 {
				t.Fatalf("no partition was dropped: before %v, after %v", before, after)
			}
			for i := range old {
				if c, err := s.Claim(ctx, fmt.Sprintf("old-%d", i), time.Minute); err != nil || c.Result != dedupe.Acquired || c.Attempt != 1 {
					t.Fatalf("old key after the prune: %+v, %v; want acquired anew", c, err)
				}
			}
			if c, err := s.Claim(ctx, "recent", time.Minute); err != nil || c.Result != dedupe.Duplicate {
				t.Fatalf("recent key after the prune: %v, %v; want duplicate", c.Result, err)
			}
			if c, err := s.Claim(ctx, "live", time.Minute); err != nil || c.Result != dedupe.Busy {
				t.Fatalf("live claim after the prune: %v, %v; want busy", c.Result, err)
			}
		})
	}
}
