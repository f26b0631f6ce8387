package dedupetest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/settle-go/settle/dedupe"
)

// The linearizability test runs random Claim, Renew, Confirm, Release and
// Prune calls from several goroutines at once (each call on whatever
// connection the store's pool gives it), with random pauses between them
// (some longer than the claim lifetime, so claims expire and are taken
// over), records every call with the times it started and returned, and asks
// porcupine whether the recorded history could have come from the claim
// state machine run one call at a time.
//
// The sequential model below is that state machine, one key at a time (keys
// are independent, so the history is checked per key). Time enters it only
// through expiry, and a call's moment inside its [start, return] window is
// unknown, so the model is nondeterministic: a claim whose deadline falls
// inside a call's window may be live or expired for that call.
//
// Prune is a garbage collector over many keys, not one atomic step: a SQL
// store deletes key by key, and may skip a row that is locked at that moment.
// The guarantee is per key: a key is deleted only at a moment when it may be,
// and never a live claim or a key written after the cutoff. So each Prune
// appears in every key's history as a step that may delete the key if the key
// is deletable then, and must leave it otherwise. The number Prune reports is
// not checked here (PruneKeepsLiveClaims checks it without concurrency).
//
// Anything a correct store can answer is accepted; an answer no ordering
// explains (a second holder, a duplicate after a rollback, a live claim
// pruned, a lost confirmation, a wrong attempt count) fails the test with the
// history drawn as an HTML page.

const (
	// linKeys is how many keys the prune race uses.
	linKeys = 16
	// linSlack widens every time window, for the gap between the clock this
	// test reads and the clock the store reads (the database server's).
	linSlack = int64(5 * time.Millisecond)
)

type linOpKind uint8

const (
	opClaim linOpKind = iota + 1
	opRenew
	opConfirm
	opRelease
	opPrune
)

func (k linOpKind) String() string {
	return [...]string{"?", "Claim", "Renew", "Confirm", "Release", "Prune"}[k]
}

// linIn is a call; times are nanoseconds since the test's start.
type linIn struct {
	op     linOpKind
	key    int    // -1 for Prune as called; its per-key copies name the key
	token  string // Renew, Confirm, Release: the token the caller holds
	ttl    int64
	call   int64
	ret    int64
	cutoff int64 // Prune
}

// linOut is what the call returned.
type linOut struct {
	res     dedupe.Result
	token   string
	attempt int
	lost    bool // ErrClaimLost
	pruned  int64
}

type linStatus uint8

const (
	stAbsent linStatus = iota
	stReleased
	stClaimed
	stConfirmed
)

// linEntry is one key in the model. Deadlines and write times are windows,
// because the store fixed them at an unknown moment of the writing call.
type linEntry struct {
	st       linStatus
	token    string
	attempts int
	dlo, dhi int64 // claim deadline
	ulo, uhi int64 // last Claim, Confirm or Release
}

func linStep(s0, in0, out0 any) []any {
	e, in, out := s0.(linEntry), in0.(linIn), out0.(linOut)
	owned := e.st == stClaimed && e.token == in.token
	switch in.op {
	case opPrune:
		if linDeletable(e, in) {
			return []any{e, linEntry{}}
		}
		return []any{e}
	case opClaim:
		mayLive := e.st == stClaimed && in.call-linSlack < e.dhi
		mayExpired := e.st == stClaimed && in.ret+linSlack >= e.dlo
		switch out.res {
		case dedupe.Acquired:
			if (e.st == stAbsent || e.st == stReleased || mayExpired) && out.attempt == e.attempts+1 {
				return []any{linEntry{st: stClaimed, token: out.token, attempts: e.attempts + 1,
					dlo: in.call + in.ttl, dhi: in.ret + in.ttl, ulo: in.call, uhi: in.ret}}
			}
		case dedupe.Duplicate:
			if e.st == stConfirmed && out.attempt == e.attempts {
				return []any{e}
			}
		case dedupe.Busy:
			if mayLive && out.attempt == e.attempts {
				return []any{e}
			}
		}
		return nil
	case opRenew:
		switch {
		case out.lost && !owned:
			return []any{e}
		case !out.lost && owned:
			e.dlo, e.dhi = in.call+in.ttl, in.ret+in.ttl
			return []any{e}
		}
		return nil
	case opConfirm, opRelease:
		switch {
		case out.lost && !owned:
			return []any{e}
		case !out.lost && owned:
			st := stConfirmed
			if in.op == opRelease {
				st = stReleased
			}
			return []any{linEntry{st: st, attempts: e.attempts, ulo: in.call, uhi: in.ret}}
		}
		return nil
	}
	return nil
}

// linDeletable reports whether Prune may delete e at some moment of its
// call: a confirmed or released key last written before the cutoff, or a
// claim taken before the cutoff that expired before both the cutoff and the
// moment of the delete.
func linDeletable(e linEntry, in linIn) bool {
	switch e.st {
	case stReleased, stConfirmed:
		return e.ulo-linSlack < in.cutoff
	case stClaimed:
		return e.ulo-linSlack < in.cutoff && e.dlo-linSlack < min(in.cutoff, in.ret)
	}
	return false
}

// linPartition splits the history by key, with a copy of every Prune in
// each key's part.
func linPartition(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[int][]porcupine.Operation{}
	var prunes []porcupine.Operation
	for _, o := range history {
		if in := o.Input.(linIn); in.op == opPrune {
			prunes = append(prunes, o)
		} else {
			byKey[in.key] = append(byKey[in.key], o)
		}
	}
	var parts [][]porcupine.Operation
	for k, ops := range byKey {
		for _, p := range prunes {
			in := p.Input.(linIn)
			in.key = k
			p.Input = in
			ops = append(ops, p)
		}
		parts = append(parts, ops)
	}
	return parts
}

var linModel = porcupine.NondeterministicModel{
	Partition: linPartition,
	Init:      func() []any { return []any{linEntry{}} },
	Step:      linStep,
	Equal: func(a, b any) bool {
		return a.(linEntry) == b.(linEntry)
	},
	DescribeOperation: func(in0, out0 any) string {
		in, out := in0.(linIn), out0.(linOut)
		switch in.op {
		case opClaim:
			return fmt.Sprintf("Claim(k%d) -> %v attempt %d %s", in.key, out.res, out.attempt, shortToken(out.token))
		case opPrune:
			return fmt.Sprintf("Prune(cutoff %v) -> %d in all", time.Duration(in.cutoff), out.pruned)
		}
		r := "ok"
		if out.lost {
			r = "lost"
		}
		return fmt.Sprintf("%v(k%d, %s) -> %s", in.op, in.key, shortToken(in.token), r)
	},
	DescribeState: func(s0 any) string {
		e := s0.(linEntry)
		return fmt.Sprintf("%s attempts %d %s", [...]string{"absent", "released", "claimed", "confirmed"}[e.st], e.attempts, shortToken(e.token))
	},
}

func shortToken(t string) string {
	if len(t) > 6 {
		return t[:6]
	}
	return t
}

// linRecorder collects the history of one run.
type linRecorder struct {
	base    time.Time
	mu      sync.Mutex
	ops     []porcupine.Operation
	aborted int // calls whose transaction was rolled back over a conflict
}

func (r *linRecorder) abort() {
	r.mu.Lock()
	r.aborted++
	r.mu.Unlock()
}

func (r *linRecorder) now() int64 { return int64(time.Since(r.base)) }

func (r *linRecorder) add(client int, in linIn, out linOut) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: in.call, Output: out, Return: in.ret})
}

// linWorkload sizes one run.
type linWorkload struct {
	keys    int
	workers int
	ops     int // per worker
	// pruner adds a worker that prunes without pause, with a cutoff in the
	// future, while the others claim and release: every released key is
	// deleted under the claims racing to take it.
	pruner bool
	// pause is the longest pause between two calls of a worker, as a
	// fraction of the claim lifetime; 0 means none.
	pause int
}

// testLinearizable runs a random workload on a few keys, with pauses that
// let claims expire, and checks the history.
func testLinearizable(t *testing.T, h Harness) {
	w := linWorkload{keys: 4, workers: 6, ops: 60, pause: 5}
	if testing.Short() {
		w.ops = 25
	}
	linRun(t, h, w)
}

// testLinearizablePruneRace runs claims and releases on more keys with no
// pauses while a pruner deletes whatever it may, and checks the history.
func testLinearizablePruneRace(t *testing.T, h Harness) {
	w := linWorkload{keys: linKeys, workers: 4, ops: 120, pruner: true}
	if testing.Short() {
		w.ops = 50
	}
	linRun(t, h, w)
}

// linRun runs w once and checks its history. Prune sees every key of the
// store, so the store must hold no other keys: one run per fresh harness.
func linRun(t *testing.T, h Harness, w linWorkload) {
	ttl := h.ClaimTTL
	if w.pause == 0 {
		ttl = longTTL // nothing expires: only the pruner races the claims
	}
	seed := rand.Uint64()
	rec := &linRecorder{base: time.Now()}
	keys := make([]string, w.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("lin-%d-%x", i, seed&0xffffff)
	}
	var (
		wg     sync.WaitGroup
		done   = make(chan struct{})
		errs   = make(chan error, w.workers+1)
		claims sync.WaitGroup
	)
	for c := range w.workers {
		claims.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			if err := linWorker(t.Context(), h.Store, rec, c, keys, w, ttl, rng); err != nil {
				errs <- err
			}
		})
	}
	if w.pruner {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				if err := linPrune1(t.Context(), h.Store, rec, w.workers, time.Now().Add(time.Hour)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	claims.Wait()
	close(done)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if rec.aborted > 0 {
		t.Logf("seed %d: %d calls recorded, %d rolled back over a conflict", seed, len(rec.ops), rec.aborted)
	}
	res, info := porcupine.CheckOperationsVerbose(linModel.ToModel(), rec.ops, time.Minute)
	switch res {
	case porcupine.Ok:
		return
	case porcupine.Unknown:
		t.Logf("seed %d: the checker timed out on %d operations; history not judged", seed, len(rec.ops))
		return
	}
	path := filepath.Join(os.TempDir(), fmt.Sprintf("dedupe-linearizability-%d.html", seed))
	if err := porcupine.VisualizePath(linModel.ToModel(), info, path); err != nil {
		t.Logf("drawing the history: %v", err)
	}
	t.Log(linExplain(info, rec.ops))
	if dump := os.Getenv("SETTLE_LIN_DUMP"); dump != "" {
		var b []byte
		ops := slices.Clone(rec.ops)
		slices.SortFunc(ops, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
		for _, o := range ops {
			in := o.Input.(linIn)
			b = fmt.Appendf(b, "c%d [%d, %d] %s\n", o.ClientId, in.call/1000, in.ret/1000, linModel.DescribeOperation(o.Input, o.Output))
		}
		_ = os.WriteFile(filepath.Join(dump, fmt.Sprintf("lin-%d.txt", seed)), b, 0o644)
	}
	t.Fatalf("seed %d: the history of %d operations is not linearizable against the claim state machine; see %s", seed, len(rec.ops), path)
}

// linPrune1 prunes once and records it.
func linPrune1(ctx context.Context, s dedupe.Store, rec *linRecorder, client int, cut time.Time) error {
	in := linIn{op: opPrune, key: -1, cutoff: int64(cut.Sub(rec.base)), call: rec.now()}
	n, err := s.Prune(ctx, cut)
	in.ret = rec.now()
	if errors.Is(err, errTxAborted) {
		rec.abort()
		return nil
	}
	if err != nil {
		return fmt.Errorf("prune: %w", err)
	}
	rec.add(client, in, linOut{pruned: n})
	return nil
}

// linWorker is one client: it claims keys, keeps the claims it won, and
// renews, confirms or releases them (or a stale claim it lost) at random.
func linWorker(ctx context.Context, s dedupe.Store, rec *linRecorder, client int, keys []string, w linWorkload, ttl time.Duration, rng *rand.Rand) error {
	held := map[int]dedupe.Claim{}  // claims this worker won and has not ended
	stale := map[int]dedupe.Claim{} // claims it ended, to try again
	for range w.ops {
		if w.pause > 0 {
			d := time.Duration(rng.Int64N(int64(ttl) / int64(w.pause)))
			if rng.IntN(100) < 8 {
				d = ttl + ttl/3 // long enough for a held claim to expire
			}
			time.Sleep(d)
		}

		if !w.pruner && rng.IntN(100) < 5 {
			cutoffs := []time.Duration{0, -ttl / 2, -time.Hour, ttl}
			if err := linPrune1(ctx, s, rec, client, time.Now().Add(cutoffs[rng.IntN(len(cutoffs))])); err != nil {
				return err
			}
			continue
		}

		k := rng.IntN(len(keys))
		c, holding := held[k]
		if !holding && rng.IntN(100) < 15 {
			c, holding = stale[k]
		}
		if !holding || rng.IntN(100) < 10 {
			in := linIn{op: opClaim, key: k, ttl: int64(ttl), call: rec.now()}
			got, err := s.Claim(ctx, keys[k], ttl)
			in.ret = rec.now()
			if errors.Is(err, errTxAborted) {
				rec.abort()
				continue // rolled back: it changed nothing
			}
			if err != nil {
				return fmt.Errorf("claim: %w", err)
			}
			rec.add(client, in, linOut{res: got.Result, token: got.Token, attempt: got.Attempt})
			if got.Result == dedupe.Acquired {
				if old, ok := held[k]; ok {
					stale[k] = old
				}
				held[k] = got
			}
			continue
		}

		in := linIn{key: k, token: c.Token, ttl: int64(ttl)}
		var err error
		switch r := rng.IntN(100); {
		case r < 35:
			in.op, in.call = opRenew, rec.now()
			err = s.Renew(ctx, c, ttl)
		case r < 70:
			in.op, in.call = opConfirm, rec.now()
			err = s.Confirm(ctx, c)
		default:
			in.op, in.call = opRelease, rec.now()
			err = s.Release(ctx, c)
		}
		in.ret = rec.now()
		if errors.Is(err, errTxAborted) {
			rec.abort()
			continue // rolled back: it changed nothing, the claim is as it was
		}
		lost := errors.Is(err, dedupe.ErrClaimLost)
		if err != nil && !lost {
			return fmt.Errorf("%v: %w", in.op, err)
		}
		rec.add(client, in, linOut{lost: lost})
		if in.op != opRenew || lost {
			if held[k].Token == c.Token {
				delete(held, k)
			}
			stale[k] = c
		}
	}
	return nil
}

// linExplain describes where the checker got stuck: the end of the longest
// order it found, and the calls it could not add after it.
func linExplain(info porcupine.LinearizationInfo, ops []porcupine.Operation) string {
	var longest []porcupine.Operation
	for _, part := range info.PartialLinearizationsOperations() {
		for _, l := range part {
			if len(l) > len(longest) {
				longest = l
			}
		}
	}
	desc := func(o porcupine.Operation) string {
		in := o.Input.(linIn)
		return fmt.Sprintf("c%d [%v, %v] %s", o.ClientId, time.Duration(in.call).Round(time.Microsecond), time.Duration(in.ret).Round(time.Microsecond), linModel.DescribeOperation(o.Input, o.Output))
	}
	var b []byte
	b = fmt.Appendf(b, "longest order found: %d of %d calls; its last calls:\n", len(longest), len(ops))
	for _, o := range longest[max(0, len(longest)-12):] {
		b = fmt.Appendf(b, "  %s\n", desc(o))
	}
	in := map[linIn]bool{}
	for _, o := range longest {
		in[o.Input.(linIn)] = true
	}
	var next []porcupine.Operation
	for _, o := range ops {
		if !in[o.Input.(linIn)] {
			next = append(next, o)
		}
	}
	slices.SortFunc(next, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
	b = fmt.Appendf(b, "first calls left out:\n")
	for _, o := range next[:min(8, len(next))] {
		b = fmt.Appendf(b, "  %s\n", desc(o))
	}
	return string(b)
}
