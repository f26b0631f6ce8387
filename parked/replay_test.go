package parked_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
)

// A replay writes one copy per parked row through the outbox, in the
// transaction that marks the row: the copy is the message, without
// settle's failure keys, with the replay keys and the UUID of its replay;
// the rows and the group counts say so; Preview said so before.
func TestReplay(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		var group string
		for i := range 3 {
			p := parkedMsg("a-"+strconv.Itoa(i), "charge", fmt.Errorf("order %d failed: %w", 17+i, errBoom))
			p.Message.Metadata.Set(settle.MetaReason, "forged by the producer")
			p.Message.Metadata.Set(settle.MetaAttempt, "9")
			p.Message.Metadata.Set("x-death", "rabbit")
			e.park(t, p)
		}
		for i := range 2 {
			e.park(t, parkedMsg("b-"+strconv.Itoa(i), "charge", fmt.Errorf("card %d declined: %w", i, errBoom)))
		}
		rows := e.all(t, parked.Filter{UUID: "a-0"})
		group = rows[0].Group
		f := parked.Filter{Group: group}
		opts := parked.ReplayOptions{By: "alice"}
		pre, err := e.Preview(t.Context(), f, opts)
		if err != nil || pre.Replayed != 3 || pre.Refused != 0 || pre.Skipped != 0 || pre.Destinations["orders"] != 3 || len(pre.Destinations) != 1 {
			t.Fatalf("Preview = %+v, %v; want 3 to orders", pre, err)
		}
		if n := len(e.outboxRows(t)); n != 0 {
			t.Fatalf("Preview wrote %d outbox rows", n)
		}
		start := time.Now()
		res, err := e.replay(t.Context(), f, opts)
		if err != nil || fmt.Sprint(res) != fmt.Sprint(pre) {
			t.Fatalf("Replay = %+v, %v; want what Preview said, %+v", res, err, pre)
		}
		out := e.outboxRows(t)
		if len(out) != 3 {
			t.Fatalf("%d outbox rows after replaying 3", len(out))
		}
		for i, o := range out {
			uuid := "a-" + strconv.Itoa(i)
			md := o.Metadata
			if o.UUID != replay.UUID(uuid, "charge", 1) || o.Topic != "orders" || string(o.Payload) != "payload of "+uuid {
				t.Errorf("copy %d: uuid %s topic %s payload %q; want %s to orders", i, o.UUID, o.Topic, o.Payload, replay.UUID(uuid, "charge", 1))
			}
			if md.Get("trace") != "t-"+uuid || md.Get(settle.MetaReplayCount) != "1" || md.Get(settle.MetaReplayOf) != uuid ||
				md.Get(settle.MetaReplayedBy) != "alice" || md.Get(settle.MetaReplayOutcome) != string(settle.DeadLettered) ||
				md.Get(settle.MetaReplayReason) != fmt.Sprintf("order %d failed: boom", 17+i) {
				t.Errorf("copy %d: metadata %v", i, md)
			}
			for _, k := range []string{settle.MetaReason, settle.MetaAttempt, "x-death"} {
				if _, ok := md[k]; ok {
					t.Errorf("copy %d carries %s", i, k)
				}
			}
			at, err := time.Parse(time.RFC3339Nano, md.Get(settle.MetaReplayedAt))
			if err != nil || at.Before(start.Add(-time.Second)) {
				t.Errorf("copy %d: replayed at %q", i, md.Get(settle.MetaReplayedAt))
			}
		}
		for _, m := range e.all(t, f) {
			if m.State != parked.StateReplayed || m.Replays != 1 || m.ReplayedBy != "alice" || m.ReplayedAt.Before(start.Add(-time.Second)) {
				t.Errorf("row after replay: %+v", m)
			}
		}
		g := e.groupsByID(t)[group]
		if g.Parked != 0 || g.Total != 3 {
			t.Errorf("group after replay: parked %d total %d; want 0, 3", g.Parked, g.Total)
		}
		e.checkGroups(t)

		// Again: nothing is parked any more.
		res, err = e.replay(t.Context(), f, opts)
		if err != nil || res.Replayed != 0 || res.Skipped != 3 || len(e.outboxRows(t)) != 3 {
			t.Fatalf("second Replay = %+v, %v, %d outbox rows; want 3 skipped and no new row", res, err, len(e.outboxRows(t)))
		}
		// Another destination when named.
		res, err = e.replay(t.Context(), parked.Filter{Handler: "charge", State: parked.StateParked}, parked.ReplayOptions{Topic: "orders_fixed"})
		if err != nil || res.Replayed != 2 || res.Destinations["orders_fixed"] != 2 {
			t.Fatalf("Replay to orders_fixed = %+v, %v", res, err)
		}
		out = e.outboxRows(t)
		if len(out) != 5 || out[3].Topic != "orders_fixed" || out[4].Topic != "orders_fixed" || out[4].Metadata.Get(settle.MetaReplayedBy) != "" {
			t.Fatalf("outbox after the replay to orders_fixed: %+v", out)
		}
		e.checkGroups(t)
	})
}

// Progress is told after each committed transaction how far the replay
// is, and its last call is the result.
func TestReplayProgress(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		parked.SetChunk(e.api, 2)
		for i := range 7 {
			e.park(t, parkedMsg("p-"+strconv.Itoa(i), "charge", errBoom))
		}
		var seen []int64
		res, err := e.replay(t.Context(), parked.Filter{Handler: "charge"}, parked.ReplayOptions{
			Progress: func(r parked.ReplayResult) { seen = append(seen, r.Replayed) },
		})
		if err != nil || res.Replayed != 7 {
			t.Fatalf("Replay = %+v, %v", res, err)
		}
		if fmt.Sprint(seen) != "[2 4 6 7]" {
			t.Errorf("Progress saw %v, want [2 4 6 7]: one call per transaction of 2 rows", seen)
		}
	})
}

// The loop guard: a message replayed MaxReplays times that failed again is
// refused, unless forced; the count travels with the copy, through the
// outbox and back into the store when the copy fails.
func TestReplayLoopGuard(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{MaxReplays: 2})
		e.park(t, parkedMsg("m", "charge", errBoom))
		for round := 1; round <= 3; round++ {
			res, err := e.replay(t.Context(), parked.Filter{State: parked.StateParked}, parked.ReplayOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out := e.outboxRows(t)
			if round <= 2 {
				if res.Replayed != 1 || len(out) != round {
					t.Fatalf("round %d: %+v, %d outbox rows; want one more copy", round, res, len(out))
				}
				if got := out[round-1].Metadata.Get(settle.MetaReplayCount); got != strconv.Itoa(round) {
					t.Fatalf("round %d: copy says replay count %s", round, got)
				}
			} else {
				pre, _ := e.Preview(t.Context(), parked.Filter{State: parked.StateParked}, parked.ReplayOptions{})
				if res.Replayed != 0 || res.Refused != 1 || len(out) != 2 || pre.Refused != 1 {
					t.Fatalf("round %d: %+v (preview %+v), %d outbox rows; want the copy of a message replayed twice refused", round, res, pre, len(out))
				}
				break
			}
			// The copy fails again and is parked, under its own UUID.
			last := out[len(out)-1]
			cp := message.NewMessage(last.UUID, last.Payload)
			cp.Metadata = last.Metadata
			p := parkedMsg("", "charge", errBoom)
			p.Message = cp
			e.park(t, p)
		}
		res, err := e.replay(t.Context(), parked.Filter{State: parked.StateParked}, parked.ReplayOptions{Force: true})
		out := e.outboxRows(t)
		if err != nil || res.Replayed != 1 || len(out) != 3 || out[2].Metadata.Get(settle.MetaReplayCount) != "3" {
			t.Fatalf("forced replay: %+v, %v, %d outbox rows; want the copy replayed a third time", res, err, len(out))
		}
		// A forged count is recorded as sent: refused without Force.
		p := parkedMsg("forged", "charge", errBoom)
		p.Message.Metadata.Set(settle.MetaReplayCount, "99")
		e.park(t, p)
		if res, _ := e.replay(t.Context(), parked.Filter{UUID: "forged"}, parked.ReplayOptions{}); res.Refused != 1 {
			t.Fatalf("a message forged as replayed 99 times: %+v; want refused", res)
		}
		e.checkGroups(t)
	})
}

// Replays of one group started at once, each on its own pool, with random
// delays and small transactions: every message gets exactly one outbox
// row, and the replays' counts add up.
func TestConcurrentReplays(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		const workers, n, iterations = 3, 30, 4
		hs := make([]handle, workers)
		for i := range hs {
			hs[i] = e.another(t)
			parked.SetChunk(hs[i].api, 1+rand.IntN(9))
		}
		var want []string
		for it := range iterations {
			var f parked.Filter
			for i := range n {
				uuid := fmt.Sprintf("it%d-%d", it, i)
				p := parkedMsg(uuid, "charge", fmt.Errorf("iteration %d: %w", it, fmt.Errorf("%d", it*1000)))
				p.Handler = fmt.Sprintf("charge-%d", it)
				e.park(t, p)
				want = append(want, replay.UUID(uuid, p.Handler, 1))
				f.Handler = p.Handler
			}
			var wg sync.WaitGroup
			results := make([]parked.ReplayResult, workers)
			errs := make([]error, workers)
			for w, h := range hs {
				wg.Go(func() {
					time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
					results[w], errs[w] = h.replay(t.Context(), f, parked.ReplayOptions{By: "w" + strconv.Itoa(w)})
				})
			}
			wg.Wait()
			var replayed int64
			for w := range hs {
				if errs[w] != nil {
					t.Fatalf("iteration %d: replay %d: %v", it, w, errs[w])
				}
				replayed += results[w].Replayed
			}
			if replayed != n {
				t.Errorf("iteration %d: the replays say they replayed %d messages (%+v); want %d", it, replayed, results, n)
			}
		}
		checkOnce(t, e.outboxRows(t), want)
		e.checkGroups(t)
	})
}

// checkOnce fails unless the outbox holds exactly one row per UUID of want.
func checkOnce(t *testing.T, out []outboxRow, want []string) {
	t.Helper()
	got := map[string]int{}
	for _, o := range out {
		got[o.UUID]++
	}
	for _, u := range want {
		if got[u] != 1 {
			t.Errorf("copy %s is in the outbox %d times, want once", u, got[u])
		}
		delete(got, u)
	}
	if len(got) > 0 {
		t.Errorf("unexpected outbox rows: %v", got)
	}
	if len(out) != len(want) {
		t.Errorf("%d outbox rows, want %d", len(out), len(want))
	}
}

// A replay cancelled part-way and run again replays every message once:
// the transactions it committed stay, the one it was in rolls back whole.
// Half the replays are cancelled at a random time (in a transaction, or
// between two), half right after a transaction committed (told by the
// store's log).
func TestReplayInterrupted(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		var (
			mu      sync.Mutex
			cancel  context.CancelFunc
			commits int
			after   int
		)
		logged := e.openWith(t, e.db, parked.Config{Logger: commitLogger(func() {
			mu.Lock()
			defer mu.Unlock()
			if commits++; commits == after {
				cancel()
			}
		})})
		parked.SetChunk(logged.api, 4)
		parked.SetChunk(e.api, 4)
		const n, iterations = 24, 8
		var want []string
		interrupted := 0
		for it := range iterations {
			handler := fmt.Sprintf("h%d", it)
			for i := range n {
				uuid := fmt.Sprintf("it%d-%d", it, i)
				p := parkedMsg(uuid, handler, errBoom)
				p.Handler = handler
				e.park(t, p)
				want = append(want, replay.UUID(uuid, handler, 1))
			}
			f := parked.Filter{Handler: handler}
			var first parked.ReplayResult
			var err error
			if it%2 == 0 {
				ctx, stop := context.WithTimeout(t.Context(), time.Duration(rand.IntN(40000))*time.Microsecond)
				first, err = e.replay(ctx, f, parked.ReplayOptions{})
				stop()
			} else {
				ctx, stop := context.WithCancel(t.Context())
				mu.Lock()
				cancel, commits, after = stop, 0, 1+rand.IntN(n/4-1)
				mu.Unlock()
				first, err = logged.replay(ctx, f, parked.ReplayOptions{})
				stop()
				if err == nil || first.Replayed != int64(4*after) {
					t.Errorf("iteration %d: cancelled after %d transactions: %+v, %v; want %d replayed and the error", it, after, first, err, 4*after)
				}
			}
			if err != nil {
				interrupted++
			}
			second, err := e.replay(t.Context(), f, parked.ReplayOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if first.Replayed+second.Replayed != n {
				t.Errorf("iteration %d: replayed %d, then %d; want %d in all", it, first.Replayed, second.Replayed, n)
			}
		}
		checkOnce(t, e.outboxRows(t), want)
		e.checkGroups(t)
		t.Logf("%d of %d replays interrupted", interrupted, iterations)
	})
}

// commitLogger calls committed at each transaction of a replay that
// committed (the store logs it at debug level).
type commitLogger func()

func (l commitLogger) Error(string, error, watermill.LogFields) {}
func (l commitLogger) Info(string, watermill.LogFields)         {}
func (l commitLogger) Trace(string, watermill.LogFields)        {}
func (l commitLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}
func (l commitLogger) Debug(msg string, _ watermill.LogFields) {
	if msg == "parked: replayed" {
		l()
	}
}

// Replay wakes the relays of its outbox in this process once it commits:
// a relay that would not poll for an hour forwards the copies at once.
func TestReplayWakesRelay(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		for i := range 3 {
			e.park(t, parkedMsg("m"+strconv.Itoa(i), "charge", errBoom))
		}
		broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
		defer broker.Close()
		msgs, err := broker.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		r, err := e.relay(broker, outbox.RelayConfig{PollInterval: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		var wg sync.WaitGroup
		wg.Go(func() { _ = r.Run(ctx) })
		defer func() { cancel(); _ = r.Close(); wg.Wait() }()
		<-r.Running()
		time.Sleep(50 * time.Millisecond) // past the relay's first look
		if res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{}); err != nil || res.Replayed != 3 {
			t.Fatalf("Replay = %+v, %v", res, err)
		}
		for i := range 3 {
			select {
			case m := <-msgs:
				m.Ack()
			case <-time.After(10 * time.Second):
				t.Fatalf("copy %d not forwarded 10s after the replay: the relay was not woken", i)
			}
		}
	})
}

// A copy is addressed to its row's handler (settle.MetaReplayHandler),
// whatever the original carried under that key, and its UUID is one per
// row: two handlers' rows of one message give two copies.
func TestReplayAddressesTheRowsHandler(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		for _, h := range []string{"charge", "email"} {
			p := parkedMsg("m1", h, errBoom)
			p.Message.Metadata.Set(settle.MetaReplayHandler, "forged")
			e.park(t, p)
		}
		if res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{}); err != nil || res.Replayed != 2 {
			t.Fatalf("replay: %+v, %v", res, err)
		}
		got := map[string]string{}
		for _, r := range e.outboxRows(t) {
			got[r.Metadata[settle.MetaReplayHandler]] = r.UUID
		}
		for _, h := range []string{"charge", "email"} {
			if got[h] != replay.UUID("m1", h, 1) {
				t.Errorf("copy for %s: uuid %q, want %s (copies by handler: %v)", h, got[h], replay.UUID("m1", h, 1), got)
			}
		}
		if len(got) != 2 {
			t.Errorf("copies addressed to %v, want charge and email only", got)
		}
	})
}
