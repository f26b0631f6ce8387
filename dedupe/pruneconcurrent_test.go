package dedupe_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// TestPartitionedConcurrentPrunes: several processes prune one partitioned
// table at the same time (each service's own regular Prune), while claims
// run, for several periods: every Prune succeeds, whatever the others are
// dropping, listing or creating meanwhile, and between them they drop the
// partitions that are over, while a live claim stays.
func TestPartitionedConcurrentPrunes(t *testing.T) {
	t.Parallel()
	for _, db := range partitionedDBs(t) {
		t.Run(string(db.Dialect), func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			s := partitionedStore(t, db)
			live, err := s.Claim(ctx, "live", 10*time.Minute)
			if err != nil || live.Result != dedupe.Acquired {
				t.Fatalf("Claim(live): %v, %v", live.Result, err)
			}
			const pruners, claimers = 4, 2
			end := time.Now().Add(6 * testPeriod)
			var (
				wg        sync.WaitGroup
				mu        sync.Mutex
				pruneErrs []error
				prunes    atomic.Int64
				removed   atomic.Int64
				confirmed = make([]int, claimers)
			)
			for range pruners {
				wg.Go(func() {
					for time.Now().Before(end) && ctx.Err() == nil {
						n, err := s.Prune(ctx, time.Now())
						prunes.Add(1)
						removed.Add(n)
						if err != nil {
							mu.Lock()
							pruneErrs = append(pruneErrs, err)
							mu.Unlock()
						}
					}
				})
			}
			for w := range claimers {
				wg.Go(func() {
					for i := 0; time.Now().Before(end) && ctx.Err() == nil; i++ {
						key := fmt.Sprintf("w%d-%d", w, i)
						c, err := s.Claim(ctx, key, time.Minute)
						if err != nil || c.Result != dedupe.Acquired {
							t.Errorf("Claim(%s): %v, %v", key, c.Result, err)
							return
						}
						if err := s.Confirm(ctx, c); err != nil {
							t.Errorf("Confirm(%s): %v", key, err)
							return
						}
						confirmed[w]++
						time.Sleep(20 * time.Millisecond)
					}
				})
			}
			wg.Wait()
			if len(pruneErrs) > 0 {
				t.Errorf("%d of %d concurrent prunes failed; the first: %v", len(pruneErrs), prunes.Load(), pruneErrs[0])
				for _, err := range pruneErrs[1:min(len(pruneErrs), 5)] {
					t.Logf("also: %v", err)
				}
			}
			if removed.Load() == 0 {
				t.Errorf("%d prunes over %v removed no key", prunes.Load(), 6*testPeriod)
			}
			if c, err := s.Claim(ctx, "live", time.Minute); err != nil || c.Result != dedupe.Busy {
				t.Errorf("live claim after the prunes: %v, %v; want busy", c.Result, err)
			}
			// Between them the prunes dropped every partition that was over
			// two periods before they stopped.
			buckets, err := dedupe.PartitionBuckets(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			over := end.Add(-2 * testPeriod).UnixMicro()
			for _, b := range buckets {
				if (b+1)*testPeriod.Microseconds() <= over {
					t.Errorf("partition %d, over since %v, is still there after the prunes", b, time.UnixMicro((b+1)*testPeriod.Microseconds()))
				}
			}
			for w, n := range confirmed {
				if n == 0 {
					t.Errorf("worker %d confirmed no key while the prunes ran", w)
				}
			}
		})
	}
}
