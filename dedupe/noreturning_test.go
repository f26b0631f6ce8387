package dedupe_test

import (
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// TestClaimWithoutReturningKeepsItsAttempt: on a MySQL server, which has
// no INSERT … RETURNING, a claim writes the key and then reads its row
// back. A claim whose lifetime ends between the two, and whose key another
// worker takes over meanwhile, still acquired the key and counted an
// attempt: it must answer Acquired, not Busy for an attempt it spent. Run
// on MariaDB made to claim as on MySQL, with the plain and the partitioned
// table: the worker that takes the key over does so while the claim waits
// between its write and its read-back.
func TestClaimWithoutReturningKeepsItsAttempt(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t)
	for _, partitioned := range []bool{false, true} {
		name := "plain"
		if partitioned {
			name = "partitioned"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			var s *dedupe.SQLStore[*sql.Tx]
			var cfg dedupe.SQLConfig
			if partitioned {
				var table string
				s, table = partitionedStoreTable(t, db)
				cfg = dedupe.SQLConfig{Table: table, Partition: testPeriod}
			} else {
				cfg = dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)}
				var err error
				if s, err = dedupe.NewSQLStore(db.Driver(), cfg); err != nil {
					t.Fatal(err)
				}
			}
			other, err := dedupe.NewSQLStore(db.Driver(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			dedupe.WithoutReturning(s)
			// How long the claim waits for the other one between its write
			// and its read-back. On the partitioned table the other claim
			// waits for the key's named lock, which the claim holds there,
			// for a second only in these tests (SetTxLockWait): it must get
			// it once the claim is over.
			wait := 3 * time.Second
			if partitioned {
				wait = 300 * time.Millisecond
			}
			const key, ttl = "k", 20 * time.Millisecond
			type result struct {
				c   dedupe.Claim
				err error
			}
			taken := make(chan result, 1)
			var once sync.Once
			dedupe.SetAfterClaimWrite(s, func() {
				once.Do(func() {
					// The claim just written expires, and another worker
					// claims the key.
					time.Sleep(10 * ttl)
					go func() {
						c, err := other.Claim(ctx, key, time.Minute)
						taken <- result{c, err}
					}()
					// Wait for the other claim, or, while the claim just
					// written holds the key until its read-back, a while.
					select {
					case r := <-taken:
						taken <- r
					case <-time.After(wait):
					}
				})
			})
			first, err := s.Claim(ctx, key, ttl)
			if err != nil {
				t.Fatalf("Claim: %v", err)
			}
			var second result
			select {
			case second = <-taken:
			case <-time.After(time.Minute):
				t.Fatal("the other worker's claim did not end within a minute")
			}
			if second.err != nil {
				t.Fatalf("the other worker's Claim: %v", second.err)
			}
			// Two attempts were counted (the other worker's claim is the
			// second): each must be a claim that acquired the key.
			if first.Result != dedupe.Acquired || first.Attempt != 1 {
				t.Errorf("the claim that expired before its read-back: %v, attempt %d; want acquired, attempt 1", first.Result, first.Attempt)
			}
			if second.c.Result != dedupe.Acquired || second.c.Attempt != 2 {
				t.Errorf("the other worker's claim: %v, attempt %d; want acquired, attempt 2", second.c.Result, second.c.Attempt)
			}
			// The key is the other worker's: the first claim's owner cannot
			// confirm it, the other can.
			if err := s.Confirm(ctx, first); err == nil {
				t.Error("the claim taken over was confirmed")
			}
			if err := other.Confirm(ctx, second.c); err != nil {
				t.Errorf("Confirm of the other worker's claim: %v", err)
			}
			if c, err := other.Claim(ctx, key, time.Minute); err != nil || c.Result != dedupe.Duplicate || c.Attempt != 2 {
				t.Errorf("Claim after the confirmation: %+v, %v; want duplicate, attempt 2", c, err)
			}
		})
	}
}
