package dedupetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// TxLevel is one isolation level at which the suite runs the store's
// operations inside a caller's transaction.
type TxLevel struct {
	// Name names the level in the subtests ("read-committed").
	Name string
	// Begin starts a transaction at the level and returns the store bound
	// to it. It must take the transaction's snapshot at once (read the
	// claims table, as a handler that reads before it confirms does), so
	// that the store's statements in it run against a snapshot older than
	// what other workers did meanwhile.
	Begin func(ctx context.Context) (Tx, error)
}

// levels returns the isolation levels to test: TxLevels, or BeginTx alone.
func (h Harness) levels() []TxLevel {
	if len(h.TxLevels) > 0 {
		return h.TxLevels
	}
	if h.BeginTx == nil {
		return nil
	}
	return []TxLevel{{Name: "default", Begin: h.BeginTx}}
}

// aborted reports an error by which the database rolled the caller's
// transaction back over a conflict (Harness.TxAborted).
func (h Harness) aborted(err error) bool {
	return err != nil && h.TxAborted != nil && h.TxAborted(err)
}

// txCases run at every isolation level of the harness, each on a fresh
// harness.
var txCases = []struct {
	name string
	fn   func(t *testing.T, h Harness, lv TxLevel)
}{
	{"RollbackLeavesNoTrace", testTxRollback},
	{"CommitConfirms", testTxCommit},
	{"ZombieAfterTakeover", testTxZombie},
	{"EveryOperation", testTxEveryOperation},
	{"Linearizable", testTxLinearizable},
}

// runTxCase runs c at each level of setup's harnesses, in parallel, each
// level on a harness of its own (the first on h).
func runTxCase(t *testing.T, h Harness, setup func(t *testing.T) Harness, fn func(t *testing.T, h Harness, lv TxLevel)) {
	levels := h.levels()
	if len(levels) == 0 {
		t.Skip("store has no transactions")
	}
	for i, lv := range levels {
		t.Run(lv.Name, func(t *testing.T) {
			t.Parallel()
			hl := h
			if i > 0 {
				hl = withDefaults(setup(t))
				lv = hl.levels()[i]
			}
			fn(t, hl, lv)
		})
	}
}

func withDefaults(h Harness) Harness {
	if h.ClaimTTL == 0 {
		h.ClaimTTL = 300 * time.Millisecond
	}
	return h
}

func beginAt(t *testing.T, lv TxLevel) Tx {
	t.Helper()
	tx, err := lv.Begin(t.Context())
	mustOK(t, "begin "+lv.Name, err)
	return tx
}

// retryAborted runs fn, and runs it again while the database aborts its
// transaction over a conflict with another transaction (as a caller
// would), for up to 20s.
func retryAborted(h Harness, fn func() error) error {
	deadline := time.Now().Add(20 * time.Second)
	for try := 1; ; try++ {
		err := fn()
		if !h.aborted(err) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(min(time.Duration(try)*5*time.Millisecond, 100*time.Millisecond))
	}
}

// claimConfirmIn claims key in a transaction at lv, confirms it, and ends
// the transaction with end (Commit or Rollback), again while the database
// aborts it over a conflict.
func claimConfirmIn(t *testing.T, h Harness, lv TxLevel, key string, end func(Tx) error) {
	t.Helper()
	ctx := t.Context()
	err := retryAborted(h, func() error {
		tx, err := lv.Begin(ctx)
		if err != nil {
			return err
		}
		c, err := tx.Store.Claim(ctx, key, longTTL)
		switch {
		case err != nil:
		case c.Result != dedupe.Acquired:
			err = fmt.Errorf("Claim(%q) in a transaction = %v, want acquired", key, c.Result)
		default:
			err = tx.Store.Confirm(ctx, c)
		}
		if err != nil {
			_ = tx.Rollback()
			return err
		}
		return end(tx)
	})
	mustOK(t, "claim and confirm in a transaction", err)
}

func testTxRollback(t *testing.T, h Harness, lv TxLevel) {
	claimConfirmIn(t, h, lv, "tx-key", func(tx Tx) error { return tx.Rollback() })
	again := claim(t, h.Store, "tx-key", longTTL, dedupe.Acquired)
	if again.Attempt != 1 {
		t.Fatalf("after rollback Attempt = %d, want 1 (no trace of the rolled-back claim)", again.Attempt)
	}
}

func testTxCommit(t *testing.T, h Harness, lv TxLevel) {
	claimConfirmIn(t, h, lv, "tx-key", func(tx Tx) error { return tx.Commit() })
	claim(t, h.Store, "tx-key", longTTL, dedupe.Duplicate)
}

// testTxZombie is the zombie worker, step by step: worker A claims a key
// (outside any transaction), begins its transaction and reads, so that its
// snapshot holds its claim; A's claim expires (A stalled: a pause, a
// SIGSTOP); worker B takes the key over and commits its effect and its
// confirmation; then A, in its old transaction, confirms (or renews, or
// releases). Whatever the isolation level, A must be told that it lost the
// claim (ErrClaimLost), or its transaction must be rolled back over the
// conflict (Harness.TxAborted); never may it confirm, so that its effect
// commits beside B's.
//
// On a database where A's open transaction keeps B from taking the key
// over (SQLite, BEGIN IMMEDIATE) B waits for A, and A, still the owner,
// may confirm; the key must still have one effect.
func testTxZombie(t *testing.T, h Harness, lv TxLevel) {
	for _, op := range []string{"Confirm", "Renew", "Release"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			zombie(t, h, lv, op)
		})
	}
}

func zombie(t *testing.T, h Harness, lv TxLevel, op string) {
	ctx := t.Context()
	key := "zombie-" + op
	a := claim(t, h.Store, key, h.ClaimTTL, dedupe.Acquired)
	txA := beginAt(t, lv) // its snapshot holds A's claim
	aEffect := false
	if op == "Confirm" && txA.Effect != nil {
		// Another test's writer may keep A's transaction from writing
		// (SQLite, DEFERRED); then so is its confirmation, below.
		switch err := txA.Effect(ctx, key); {
		case err == nil:
			aEffect = true
		case !h.aborted(err):
			t.Fatalf("A's effect: %v", err)
		}
	}

	// B, once A's claim has expired: takes it over, and commits its effect
	// and its confirmation in a transaction of its own.
	type outcome struct {
		res dedupe.Result
		ok  bool // B confirmed and committed
		err error
	}
	bDone := make(chan outcome, 1)
	go func() {
		bDone <- func() outcome {
			time.Sleep(time.Until(a.ExpiresAt) + 10*time.Millisecond)
			deadline := time.Now().Add(20*h.ClaimTTL + 5*time.Second)
			for {
				b, err := h.Store.Claim(ctx, key, longTTL)
				if err != nil {
					return outcome{err: fmt.Errorf("claim of worker B: %w", err)}
				}
				if b.Result != dedupe.Busy || time.Now().After(deadline) {
					if b.Result != dedupe.Acquired {
						return outcome{res: b.Result}
					}
					return bConfirm(ctx, h, lv, b, func(ok bool, err error) outcome {
						return outcome{res: b.Result, ok: ok, err: err}
					})
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}()

	// A wakes up when B is done, or when B has had time enough and is held
	// back, as on SQLite, by A's own transaction.
	var b outcome
	bFinished := false
	select {
	case b = <-bDone:
		bFinished = true
	case <-time.After(time.Until(a.ExpiresAt) + 3*time.Second):
	}
	if bFinished && b.err != nil {
		t.Fatal(b.err)
	}
	var err error
	switch op {
	case "Confirm":
		err = txA.Store.Confirm(ctx, a)
	case "Renew":
		err = txA.Store.Renew(ctx, a, h.ClaimTTL)
	case "Release":
		err = txA.Store.Release(ctx, a)
	}
	aOK := false
	switch {
	case err == nil:
		cerr := txA.Commit()
		if cerr != nil && !h.aborted(cerr) {
			t.Fatalf("A's commit after its %s: %v", op, cerr)
		}
		aOK = cerr == nil
	case errors.Is(err, dedupe.ErrClaimLost), h.aborted(err):
		_ = txA.Rollback()
	default:
		_ = txA.Rollback()
		t.Fatalf("A's %s in its transaction: %v (want ErrClaimLost, or the transaction rolled back over the conflict)", op, err)
	}
	if !bFinished {
		b = <-bDone
		if b.err != nil {
			t.Fatal(b.err)
		}
	}
	if aOK && bFinished && b.res == dedupe.Acquired {
		t.Errorf("%s: A's %s succeeded in a transaction whose snapshot predates B's takeover (B acquired the key and confirmed=%v before): A acted on a claim it had lost", lv.Name, op, b.ok)
	}
	t.Logf("%s %s: A's %s returned %v (committed %v); B finished before A acted: %v, its claim %v, confirmed %v", lv.Name, key, op, err, aOK, bFinished, b.res, b.ok)

	switch op {
	case "Confirm":
		if done := btoi(aOK) + btoi(b.ok); done != 1 {
			t.Errorf("%d confirmations committed (A %v, B %v), want exactly 1", done, aOK, b.ok)
		}
		if h.Effects != nil {
			n, err := h.Effects(ctx, key)
			mustOK(t, "count effects", err)
			want := btoi(aOK && aEffect) + btoi(b.ok)
			if n != want || n != 1 {
				t.Errorf("%d effect rows of %s committed, want exactly 1 (A committed %v, B %v)", n, key, aOK, b.ok)
			}
		}
		claim(t, h.Store, key, longTTL, dedupe.Duplicate)
	case "Renew", "Release":
		if b.res == dedupe.Acquired && !b.ok {
			t.Errorf("B acquired the key but could not confirm it after A's %s", op)
		}
	}
}

// bConfirm commits worker B's effect and confirmation in a transaction of
// its own at the same level (again while the database aborts it over a
// conflict with A's), and hands the outcome to done.
func bConfirm[T any](ctx context.Context, h Harness, lv TxLevel, b dedupe.Claim, done func(ok bool, err error) T) T {
	err := retryAborted(h, func() error {
		tx, err := lv.Begin(ctx)
		if err != nil {
			return err
		}
		if tx.Effect != nil {
			if err := tx.Effect(ctx, b.Key); err != nil {
				_ = tx.Rollback()
				return err
			}
		}
		if err := tx.Store.Confirm(ctx, b); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return done(false, fmt.Errorf("effect and confirmation of worker B: %w", err))
	}
	return done(true, nil)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// txStore is a Store that runs each call in a transaction of its own, begun
// at level (its snapshot taken), held open for pause() before the call,
// and committed after it: every operation inside a caller's transaction.
// An error by which the database rolled the transaction back over a
// conflict is errTxAborted.
type txStore struct {
	level   TxLevel
	aborted func(error) bool
	pause   func() time.Duration // nil for none
	// retry runs a call whose transaction was rolled back over a conflict
	// again, in a new transaction, as a caller would (for up to 20s).
	retry bool
}

// errTxAborted wraps an error by which the database rolled a txStore
// call's transaction back over a conflict: the call changed nothing.
var errTxAborted = errors.New("dedupetest: the transaction was rolled back over a conflict")

func (s txStore) run(ctx context.Context, fn func(dedupe.Store) error) error {
	deadline := time.Now().Add(20 * time.Second)
	for try := 1; ; try++ {
		err := s.run1(ctx, fn)
		if !s.retry || time.Now().After(deadline) || !errors.Is(err, errTxAborted) {
			return err
		}
		time.Sleep(min(time.Duration(try)*5*time.Millisecond, 100*time.Millisecond))
	}
}

func (s txStore) run1(ctx context.Context, fn func(dedupe.Store) error) error {
	tx, err := s.level.Begin(ctx)
	if err != nil {
		if s.aborted != nil && s.aborted(err) {
			return fmt.Errorf("%w: begin: %w", errTxAborted, err) // it never began
		}
		return err
	}
	if s.pause != nil {
		if d := s.pause(); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
	if err := fn(tx.Store); err != nil {
		_ = tx.Rollback()
		if s.aborted != nil && s.aborted(err) {
			return fmt.Errorf("%w: %w", errTxAborted, err)
		}
		return err
	}
	if err := tx.Commit(); err != nil {
		if s.aborted != nil && s.aborted(err) {
			return fmt.Errorf("%w: commit: %w", errTxAborted, err)
		}
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func (s txStore) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	var c dedupe.Claim
	err := s.run(ctx, func(st dedupe.Store) (err error) {
		c, err = st.Claim(ctx, key, ttl)
		return err
	})
	if err != nil {
		return dedupe.Claim{}, err
	}
	return c, nil
}

func (s txStore) Renew(ctx context.Context, c dedupe.Claim, ttl time.Duration) error {
	return s.run(ctx, func(st dedupe.Store) error { return st.Renew(ctx, c, ttl) })
}

func (s txStore) Confirm(ctx context.Context, c dedupe.Claim) error {
	return s.run(ctx, func(st dedupe.Store) error { return st.Confirm(ctx, c) })
}

func (s txStore) Release(ctx context.Context, c dedupe.Claim) error {
	return s.run(ctx, func(st dedupe.Store) error { return st.Release(ctx, c) })
}

func (s txStore) Prune(ctx context.Context, before time.Time) (int64, error) {
	var n int64
	err := s.run(ctx, func(st dedupe.Store) (err error) {
		n, err = st.Prune(ctx, before)
		return err
	})
	return n, err
}

// testTxEveryOperation runs the suite's one-worker cases with every store
// call in a transaction of its own at lv.
func testTxEveryOperation(t *testing.T, h Harness, lv TxLevel) {
	// Other tests' writers may abort a transaction (SQLite, DEFERRED): it
	// is run again, as its caller would.
	h.Store = txStore{level: lv, aborted: h.aborted, retry: true}
	h.BeginTx, h.TxLevels = nil, nil
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		// First: it counts what it deletes, so the table must hold only
		// its keys.
		{"PruneKeepsLiveClaims", testPrune},
		{"ClaimConfirmDuplicate", testClaimConfirmDuplicate},
		{"ExpiredClaimIsTakenOver", testExpiryTakeover},
		{"OwnerChecks", testOwnerChecks},
		{"ReleaseThenReclaim", testReleaseThenReclaim},
		{"AttemptsSurviveRelease", testAttempts},
		{"OddKeys", testOddKeys},
	} {
		// One after the other, on the harness's one table.
		if !t.Run(c.name, func(t *testing.T) { c.fn(t, h) }) {
			return
		}
	}
}

// testTxLinearizable is Linearizable with every call in a transaction of
// its own at lv, whose snapshot is taken before a random pause, at times
// longer than the claim lifetime: calls act on snapshots older than what
// the other workers did meanwhile, claims expire and are taken over under
// them. A call whose transaction the database rolled back over a conflict
// changed nothing and is left out of the history.
func testTxLinearizable(t *testing.T, h Harness, lv TxLevel) {
	ttl := h.ClaimTTL
	h.Store = txStore{level: lv, aborted: h.aborted, pause: func() time.Duration {
		if rand.IntN(100) < 10 {
			return ttl + ttl/3
		}
		return time.Duration(rand.Int64N(int64(ttl) / 5))
	}}
	w := linWorkload{keys: 3, workers: 6, ops: 30, pause: 8}
	if testing.Short() {
		w.ops = 15
	}
	linRun(t, h, w)
}
