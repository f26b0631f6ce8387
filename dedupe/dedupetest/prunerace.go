package dedupetest

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// testPruneRacesTakeovers prunes, with a cutoff far in the future, while
// other goroutines take over released keys. Every claim a taker acquired is
// live, so no prune may delete it: its owner must still be able to renew and
// confirm it, and the key must then be a duplicate.
func testPruneRacesTakeovers(t *testing.T, h Harness) {
	ctx := t.Context()
	const takers = 4
	n := 400
	if testing.Short() {
		n = 150
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("race-%d", i)
		c := claim(t, h.Store, keys[i], longTTL, dedupe.Acquired)
		mustOK(t, "Release", h.Store.Release(ctx, c))
	}

	var (
		wg     sync.WaitGroup
		done   atomic.Bool
		mu     sync.Mutex
		claims []dedupe.Claim
		pruned int64
	)
	errs := make(chan error, takers+1)
	wg.Go(func() {
		for !done.Load() {
			m, err := h.Store.Prune(ctx, time.Now().Add(time.Hour))
			if err != nil {
				errs <- fmt.Errorf("prune: %w", err)
				return
			}
			pruned += m
		}
	})
	var taking sync.WaitGroup
	for w := range takers {
		taking.Go(func() {
			for i := w; i < n; i += takers {
				c, err := h.Store.Claim(ctx, keys[i], longTTL)
				if err != nil {
					errs <- fmt.Errorf("claim: %w", err)
					return
				}
				if c.Result != dedupe.Acquired {
					errs <- fmt.Errorf("Claim(%s) of a released or pruned key = %v, want acquired", keys[i], c.Result)
					return
				}
				mu.Lock()
				claims = append(claims, c)
				mu.Unlock()
			}
		})
	}
	taking.Wait()
	done.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var lost int
	for _, c := range claims {
		if err := h.Store.Renew(ctx, c, longTTL); errors.Is(err, dedupe.ErrClaimLost) {
			lost++
			continue
		} else {
			mustOK(t, "Renew", err)
		}
		mustOK(t, "Confirm", h.Store.Confirm(ctx, c))
	}
	if lost > 0 {
		t.Fatalf("%d of %d live claims were deleted by a concurrent Prune (it deleted %d keys in all)", lost, len(claims), pruned)
	}
	for _, k := range keys {
		claim(t, h.Store, k, longTTL, dedupe.Duplicate)
	}
}

// testPruneRacesConfirms prunes, with a fixed cutoff, while the holders of
// expired claims confirm them. A claim that expired but was not taken over
// can still be confirmed; a key confirmed after the cutoff is within the
// retention, so every confirmation that succeeded must survive every prune.
func testPruneRacesConfirms(t *testing.T, h Harness) {
	ctx := t.Context()
	const confirmers = 4
	n := 400
	if testing.Short() {
		n = 150
	}
	ttl := 20 * time.Millisecond
	claims := make([]dedupe.Claim, n)
	for i := range claims {
		claims[i] = claim(t, h.Store, fmt.Sprintf("expired-%d", i), ttl, dedupe.Acquired)
	}
	time.Sleep(2*ttl + 10*time.Millisecond)
	cutoff := time.Now()
	time.Sleep(5 * time.Millisecond)

	var (
		wg        sync.WaitGroup
		done      atomic.Bool
		mu        sync.Mutex
		confirmed []string
	)
	errs := make(chan error, confirmers+1)
	wg.Go(func() {
		for !done.Load() {
			if _, err := h.Store.Prune(ctx, cutoff); err != nil {
				errs <- fmt.Errorf("prune: %w", err)
				return
			}
		}
	})
	var confirming sync.WaitGroup
	for w := range confirmers {
		confirming.Go(func() {
			for i := w; i < n; i += confirmers {
				err := h.Store.Confirm(ctx, claims[i])
				if errors.Is(err, dedupe.ErrClaimLost) {
					continue // pruned first: the expired claim was fair game
				}
				if err != nil {
					errs <- fmt.Errorf("confirm: %w", err)
					return
				}
				mu.Lock()
				confirmed = append(confirmed, claims[i].Key)
				mu.Unlock()
			}
		})
	}
	confirming.Wait()
	done.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var gone int
	for _, k := range confirmed {
		c, err := h.Store.Claim(ctx, k, longTTL)
		mustOK(t, "Claim", err)
		if c.Result != dedupe.Duplicate {
			gone++
		}
	}
	if gone > 0 {
		t.Fatalf("%d of %d keys confirmed after the cutoff were deleted by a concurrent Prune", gone, len(confirmed))
	}
}
