// Package dedupetest is the conformance suite for dedupe.Store
// implementations. Every store in settle passes it, and a store written
// outside settle should too:
//
//	func TestMyStore(t *testing.T) {
//		dedupetest.Run(t, func(t *testing.T) dedupetest.Harness {
//			return dedupetest.Harness{Store: newMyStore(t)}
//		})
//	}
//
// setup is called once per test, which runs in parallel with the others, so
// it should give each call its own table (or its own store) to keep the
// tests independent.
//
// A store that runs in a caller's transaction offers the isolation levels of
// its database (Harness.TxLevels), and the suite runs every store operation
// inside a transaction at each of them: a worker whose claim was taken over
// after its transaction took its snapshot must never confirm, renew or
// release it, at any level.
package dedupetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// Harness is what setup returns for one test.
type Harness struct {
	// Store is the store under test.
	Store dedupe.Store
	// BeginTx, if set, starts a transaction on the same database and returns
	// a store bound to it. Stores without transactions leave it nil and the
	// transaction tests are skipped.
	BeginTx func(ctx context.Context) (Tx, error)
	// TxLevels, if set, are the isolation levels the database offers, each
	// with the way to begin a transaction at it; the transaction tests run
	// at every one of them. When nil, BeginTx is the only level.
	TxLevels []TxLevel
	// TxAborted reports an error by which the database rolled a caller's
	// transaction back whole over a conflict with another transaction (a
	// serialization failure, a deadlock), from a store call inside the
	// transaction or from its Commit. The transaction tests accept it as the
	// answer of a transaction that changed nothing; any other error fails
	// them. Nil accepts none.
	TxAborted func(err error) bool
	// Effects, if set, counts the committed rows that Tx.Effect wrote for
	// key. The transaction tests then check the effects themselves, not
	// only what the store answered.
	Effects func(ctx context.Context, key string) (int, error)
	// ClaimTTL is the short claim lifetime used by the expiry tests. Defaults
	// to 300ms. Raise it for a store whose round trips are slow.
	ClaimTTL time.Duration
}

// Tx is a transaction started by Harness.BeginTx.
type Tx struct {
	Store    dedupe.Store
	Commit   func() error
	Rollback func() error
	// Effect, if set, writes in the transaction one row standing for a
	// handler's effect on key (Harness.Effects counts them).
	Effect func(ctx context.Context, key string) error
}

// Run runs the suite. Each case calls setup for a fresh harness.
func Run(t *testing.T, setup func(t *testing.T) Harness) {
	t.Helper()
	cases := []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"ClaimConfirmDuplicate", testClaimConfirmDuplicate},
		{"ConcurrentClaimsOneWinner", testConcurrentClaims},
		{"ExpiredClaimIsTakenOver", testExpiryTakeover},
		{"RenewalPreventsTakeover", testRenewal},
		{"OwnerChecks", testOwnerChecks},
		{"ReleaseThenReclaim", testReleaseThenReclaim},
		{"AttemptsSurviveRelease", testAttempts},
		{"PruneKeepsLiveClaims", testPrune},
		{"PruneRacesTakeovers", testPruneRacesTakeovers},
		{"PruneRacesConfirms", testPruneRacesConfirms},
		{"Linearizable", testLinearizable},
		{"LinearizablePruneRace", testLinearizablePruneRace},
		{"MiddlewareScopesKeysPerHandler", testHandlerScopes},
		{"ScopedKeysApart", testScopedKeysApart},
		{"OddKeys", testOddKeys},
		{"KeyLimits", testKeyLimits},
		{"CancelledContext", testCancelled},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, withDefaults(setup(t)))
		})
	}
	// Every operation inside a caller's transaction, at every isolation
	// level the harness offers.
	for _, c := range txCases {
		t.Run("Tx"+c.name, func(t *testing.T) {
			t.Parallel()
			runTxCase(t, withDefaults(setup(t)), setup, c.fn)
		})
	}
}

const longTTL = time.Minute

func claim(t *testing.T, s dedupe.Store, key string, ttl time.Duration, want dedupe.Result) dedupe.Claim {
	t.Helper()
	c, err := s.Claim(t.Context(), key, ttl)
	if err != nil {
		t.Fatalf("Claim(%q): %v", short(key), err)
	}
	if c.Result != want {
		t.Fatalf("Claim(%q) = %v, want %v", short(key), c.Result, want)
	}
	if c.Key != key {
		t.Fatalf("Claim(%q).Key = %q", short(key), short(c.Key))
	}
	if want == dedupe.Acquired && (c.Token == "" || c.ExpiresAt.IsZero()) {
		t.Fatalf("acquired claim without token or expiry: %+v", c)
	}
	return c
}

func short(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}

func mustOK(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func mustLost(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, dedupe.ErrClaimLost) {
		t.Fatalf("%s: got %v, want ErrClaimLost", what, err)
	}
}

func testClaimConfirmDuplicate(t *testing.T, h Harness) {
	c := claim(t, h.Store, "order:1", longTTL, dedupe.Acquired)
	if c.Attempt != 1 {
		t.Fatalf("first claim Attempt = %d, want 1", c.Attempt)
	}
	claim(t, h.Store, "order:1", longTTL, dedupe.Busy)
	claim(t, h.Store, "order:2", longTTL, dedupe.Acquired) // keys are independent
	mustOK(t, "Confirm", h.Store.Confirm(t.Context(), c))
	d := claim(t, h.Store, "order:1", longTTL, dedupe.Duplicate)
	if d.Attempt != 1 || d.Token != "" {
		t.Fatalf("duplicate claim = %+v, want Attempt 1 and no token", d)
	}
}

func testConcurrentClaims(t *testing.T, h Harness) {
	const workers = 50
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results = map[dedupe.Result]int{}
		errs    []error
	)
	start := make(chan struct{})
	for range workers {
		wg.Go(func() {
			<-start
			c, err := h.Store.Claim(t.Context(), "contended", longTTL)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			results[c.Result]++
		})
	}
	close(start)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d claims failed, first: %v", len(errs), errs[0])
	}
	if results[dedupe.Acquired] != 1 || results[dedupe.Busy] != workers-1 {
		t.Fatalf("results = %v, want exactly 1 acquired and %d busy", results, workers-1)
	}
}

// eventually polls cond every few milliseconds until it is true or the
// deadline passes.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %v", what, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func testExpiryTakeover(t *testing.T, h Harness) {
	// A claim of the key right after the first must find it busy, unless
	// the test stalled (GC, a loaded CI machine, a caller's transaction
	// begun again after a conflict) for the claim's whole lifetime between
	// the two: then the second claim takes the expired key over rightly,
	// which proves nothing either way, and the case starts again on a new
	// key, as testRenewal does. A key acquired sooner than ClaimTTL after
	// the first claim began fails the test.
	for attempt := range 5 {
		key := "k"
		if attempt > 0 {
			key = fmt.Sprintf("k-%d", attempt)
		}
		if expiryTakeover(t, h, key) {
			return
		}
		t.Logf("attempt %d: the test stalled longer than the claim's lifetime (%v); again on a new key", attempt+1, h.ClaimTTL)
	}
	t.Fatalf("every attempt stalled longer than the claim's lifetime (%v)", h.ClaimTTL)
}

// expiryTakeover is testExpiryTakeover on key. It reports false when the
// test stalled for the claim's lifetime before the busy check.
func expiryTakeover(t *testing.T, h Harness, key string) bool {
	start := time.Now() // no later than the database's time of the first claim
	old := claim(t, h.Store, key, h.ClaimTTL, dedupe.Acquired)
	busy, err := h.Store.Claim(t.Context(), key, h.ClaimTTL)
	mustOK(t, "Claim", err)
	if busy.Result != dedupe.Busy {
		if since := time.Since(start); since < h.ClaimTTL || busy.Result != dedupe.Acquired {
			t.Fatalf("Claim(%q) %v after the first claim began = %v, want busy", key, since, busy.Result)
		}
		return false
	}
	var taken dedupe.Claim
	eventually(t, 20*h.ClaimTTL, "expired claim taken over", func() bool {
		c, err := h.Store.Claim(t.Context(), key, longTTL)
		mustOK(t, "Claim", err)
		taken = c
		return c.Result == dedupe.Acquired
	})
	if time.Now().Before(old.ExpiresAt) {
		t.Fatalf("claim taken over before it expired at %v", old.ExpiresAt)
	}
	if taken.Attempt != 2 || taken.Token == old.Token {
		t.Fatalf("takeover claim = %+v, want attempt 2 and a new token", taken)
	}
	mustLost(t, "old owner Confirm", h.Store.Confirm(t.Context(), old))
	mustLost(t, "old owner Release", h.Store.Release(t.Context(), old))
	mustLost(t, "old owner Renew", h.Store.Renew(t.Context(), old, longTTL))
	mustOK(t, "new owner Confirm", h.Store.Confirm(t.Context(), taken))
	claim(t, h.Store, key, longTTL, dedupe.Duplicate)
	return true
}

func testRenewal(t *testing.T, h Harness) {
	ttl := h.ClaimTTL
	// A stall of the test process (GC, a loaded CI machine) longer than
	// the TTL between a renewal and the next claim lets the other worker
	// take the key over rightly; such an attempt proves nothing either
	// way, so it is started again on a new key. A claim that gets the key
	// sooner than the TTL after the last renewal began fails the test.
	for attempt := range 5 {
		if renewalHeld(t, h, fmt.Sprintf("renewed-%d", attempt), ttl) {
			return
		}
		t.Logf("attempt %d: the test stalled longer than the TTL (%v); again on a new key", attempt+1, ttl)
	}
	t.Fatalf("every attempt stalled longer than the TTL (%v)", ttl)
}

// renewalHeld renews a claim of key at a quarter of ttl for three TTLs,
// claiming from "another worker" in between, which must never get the
// key. It reports false when the test stalled for a TTL and the other
// worker got it.
func renewalHeld(t *testing.T, h Harness, key string, ttl time.Duration) bool {
	lastWrite := time.Now() // no later than the database's time of the last write
	c := claim(t, h.Store, key, ttl, dedupe.Acquired)
	end := time.Now().Add(3 * ttl)
	for time.Now().Before(end) {
		if time.Since(lastWrite) >= ttl/4 {
			start := time.Now()
			mustOK(t, "Renew", h.Store.Renew(t.Context(), c, ttl))
			lastWrite = start
		}
		other, err := h.Store.Claim(t.Context(), key, longTTL)
		if err != nil {
			t.Fatalf("Claim(%q): %v", key, err)
		}
		if other.Result != dedupe.Busy {
			if since := time.Since(lastWrite); since < ttl {
				t.Fatalf("Claim(%q) %v after the last renewal began = %v, want busy", key, since, other.Result)
			}
			return false
		}
		time.Sleep(ttl / 15)
	}
	mustOK(t, "Confirm after renewals", h.Store.Confirm(t.Context(), c))
	claim(t, h.Store, key, longTTL, dedupe.Duplicate)
	return true
}

func testOwnerChecks(t *testing.T, h Harness) {
	c := claim(t, h.Store, "owned", longTTL, dedupe.Acquired)
	forged := c
	forged.Token = "not-the-token"
	mustLost(t, "Confirm with another token", h.Store.Confirm(t.Context(), forged))
	mustLost(t, "Release with another token", h.Store.Release(t.Context(), forged))
	mustLost(t, "Renew with another token", h.Store.Renew(t.Context(), forged, longTTL))

	busy := claim(t, h.Store, "owned", longTTL, dedupe.Busy)
	if err := h.Store.Confirm(t.Context(), busy); !errors.Is(err, dedupe.ErrNotAcquired) {
		t.Fatalf("Confirm of a Busy result: got %v, want ErrNotAcquired", err)
	}
	unknown := c
	unknown.Key = "never-claimed"
	mustLost(t, "Confirm of a key never claimed", h.Store.Confirm(t.Context(), unknown))

	// The rightful owner is unaffected by all of that.
	mustOK(t, "Renew", h.Store.Renew(t.Context(), c, longTTL))
	mustOK(t, "Renew again", h.Store.Renew(t.Context(), c, longTTL))
	mustOK(t, "Confirm", h.Store.Confirm(t.Context(), c))
	mustLost(t, "Confirm twice", h.Store.Confirm(t.Context(), c))
	mustLost(t, "Release after Confirm", h.Store.Release(t.Context(), c))
	claim(t, h.Store, "owned", longTTL, dedupe.Duplicate)
}

func testReleaseThenReclaim(t *testing.T, h Harness) {
	c := claim(t, h.Store, "released", longTTL, dedupe.Acquired)
	mustOK(t, "Release", h.Store.Release(t.Context(), c))
	mustLost(t, "Release twice", h.Store.Release(t.Context(), c))
	mustLost(t, "Confirm after Release", h.Store.Confirm(t.Context(), c))
	c2 := claim(t, h.Store, "released", longTTL, dedupe.Acquired)
	if c2.Token == c.Token {
		t.Fatal("reclaim reused the released token")
	}
	mustOK(t, "Confirm", h.Store.Confirm(t.Context(), c2))
	claim(t, h.Store, "released", longTTL, dedupe.Duplicate)
}

func testAttempts(t *testing.T, h Harness) {
	var first time.Time
	for want := 1; want <= 3; want++ {
		c := claim(t, h.Store, "attempts", longTTL, dedupe.Acquired)
		if c.Attempt != want {
			t.Fatalf("attempt %d: Claim.Attempt = %d", want, c.Attempt)
		}
		// The first claim's time is kept: it dates the first attempt.
		if want == 1 {
			first = c.FirstAt
			if first.IsZero() || time.Since(first) > time.Minute || time.Until(first) > time.Minute {
				t.Fatalf("first claim's FirstAt = %v, want about now", first)
			}
		} else if !c.FirstAt.Equal(first) {
			t.Fatalf("attempt %d: FirstAt = %v, want the first claim's %v", want, c.FirstAt, first)
		}
		if want < 3 {
			mustOK(t, "Release", h.Store.Release(t.Context(), c))
			continue
		}
		b := claim(t, h.Store, "attempts", longTTL, dedupe.Busy)
		if b.Attempt != 3 {
			t.Fatalf("Busy.Attempt = %d, want 3", b.Attempt)
		}
		mustOK(t, "Confirm", h.Store.Confirm(t.Context(), c))
	}
	d := claim(t, h.Store, "attempts", longTTL, dedupe.Duplicate)
	if d.Attempt != 3 {
		t.Fatalf("Duplicate.Attempt = %d, want 3", d.Attempt)
	}
}

func testPrune(t *testing.T, h Harness) {
	ctx := t.Context()
	done := claim(t, h.Store, "confirmed", longTTL, dedupe.Acquired)
	mustOK(t, "Confirm", h.Store.Confirm(ctx, done))
	rel := claim(t, h.Store, "released", longTTL, dedupe.Acquired)
	mustOK(t, "Release", h.Store.Release(ctx, rel))
	live := claim(t, h.Store, "live", longTTL, dedupe.Acquired)

	n, err := h.Store.Prune(ctx, time.Now().Add(-time.Hour))
	mustOK(t, "Prune(an hour ago)", err)
	if n != 0 {
		t.Fatalf("Prune(an hour ago) removed %d keys, want 0", n)
	}
	claim(t, h.Store, "confirmed", longTTL, dedupe.Duplicate)

	// Even a cutoff far in the future must leave the live claim alone.
	n, err = h.Store.Prune(ctx, time.Now().Add(24*time.Hour))
	mustOK(t, "Prune(tomorrow)", err)
	if n != 2 {
		t.Fatalf("Prune(tomorrow) removed %d keys, want 2 (confirmed and released)", n)
	}
	claim(t, h.Store, "live", longTTL, dedupe.Busy)
	mustOK(t, "Confirm of live claim after Prune", h.Store.Confirm(ctx, live))
	again := claim(t, h.Store, "confirmed", longTTL, dedupe.Acquired)
	if again.Attempt != 1 {
		t.Fatalf("pruned key reclaimed with Attempt %d, want 1", again.Attempt)
	}
}

func testOddKeys(t *testing.T, h Harness) {
	rng := rand.New(rand.NewPCG(1, 2))
	kib := make([]byte, 1024)
	for i := range kib {
		kib[i] = byte(rng.IntN(256))
	}
	keys := []string{
		`it's a "quoted" key`,
		`'; DROP TABLE settle_dedupe; --`,
		"ключ-🔑-鍵",
		"a\x00b",
		"a",
		"A",
		"\xff\xfe\xfd",
		`back\slash%_`,
		string(kib),
		string(bytes.Repeat([]byte{'k'}, dedupe.MaxKeyLen)),
	}
	var claims []dedupe.Claim
	for _, k := range keys {
		claims = append(claims, claim(t, h.Store, k, longTTL, dedupe.Acquired))
	}
	for i, c := range claims {
		mustOK(t, "Confirm "+short(keys[i]), h.Store.Confirm(t.Context(), c))
	}
	for _, k := range keys {
		claim(t, h.Store, k, longTTL, dedupe.Duplicate)
	}
	claim(t, h.Store, "a\x00", longTTL, dedupe.Acquired) // a prefix is another key
}

func testKeyLimits(t *testing.T, h Harness) {
	_, err := h.Store.Claim(t.Context(), "", longTTL)
	if !errors.Is(err, dedupe.ErrEmptyKey) {
		t.Fatalf("empty key: got %v, want ErrEmptyKey", err)
	}
	long := string(bytes.Repeat([]byte{'x'}, dedupe.MaxKeyLen+1))
	_, err = h.Store.Claim(t.Context(), long, longTTL)
	if !errors.Is(err, dedupe.ErrKeyTooLong) {
		t.Fatalf("key of %d bytes: got %v, want ErrKeyTooLong", len(long), err)
	}
	var ke *dedupe.KeyError
	if !errors.As(err, &ke) || !ke.Permanent() || ke.Len != dedupe.MaxKeyLen+1 {
		t.Fatalf("oversized key error %v is not a permanent *KeyError with its length", err)
	}
	if _, err := h.Store.Claim(t.Context(), "ttl", 0); err == nil {
		t.Fatal("Claim with ttl 0 succeeded")
	}
}

func testCancelled(t *testing.T, h Harness) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := h.Store.Claim(ctx, "cancelled", longTTL); err == nil {
		t.Fatal("Claim with a cancelled context succeeded")
	}
	claim(t, h.Store, "cancelled", longTTL, dedupe.Acquired) // and left nothing behind
}
