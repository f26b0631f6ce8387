package parked_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/parked"
)

// Every Filter field selects what it says, on every driver, and List,
// Count and Preview agree on what a filter selects.
func TestFilters(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		base := time.UnixMicro(1_800_000_000_000_000)
		type spec struct {
			uuid, handler, topic, key, reason string
			outcome                           settle.Outcome
			at                                int // seconds after base
		}
		specs := []spec{
			{"u1", "charge", "orders", "order:1", "100% of card_x declined", settle.DeadLettered, 0},
			{"u2", "charge", "orders", "order:2", "1000 of cardyx declined", settle.DeadLettered, 10},
			{"u3", "charge", "refunds", "", "Card declined", settle.Poisoned, 20},
			{"u4", "ship", "orders", "order:1", "no address!", settle.DeadLettered, 30},
			{"u5", "ship", "orders", "order:5", "card declined", settle.Poisoned, 40},
		}
		for _, s := range specs {
			p := parkedMsg(s.uuid, s.handler, errors.New(s.reason))
			p.Topic, p.Key, p.Outcome = s.topic, s.key, s.outcome
			p.LastFailure = base.Add(time.Duration(s.at) * time.Second)
			e.park(t, p)
		}
		all := e.all(t, parked.Filter{})
		id := map[string]int64{}
		for _, m := range all {
			id[m.UUID] = m.ID
		}
		if _, err := e.Archive(t.Context(), parked.Filter{UUID: "u4"}, "bob"); err != nil {
			t.Fatal(err)
		}
		u5, _ := e.Get(t.Context(), id["u5"])

		for _, c := range []struct {
			name string
			f    parked.Filter
			want []string // uuids, newest first
		}{
			{"all", parked.Filter{}, []string{"u5", "u4", "u3", "u2", "u1"}},
			{"ids", parked.Filter{IDs: []int64{id["u1"], id["u3"], 1 << 40}}, []string{"u3", "u1"}},
			{"handler", parked.Filter{Handler: "charge"}, []string{"u3", "u2", "u1"}},
			{"topic", parked.Filter{Topic: "orders"}, []string{"u5", "u4", "u2", "u1"}},
			{"outcome", parked.Filter{Outcome: settle.Poisoned}, []string{"u5", "u3"}},
			{"group", parked.Filter{Group: u5.Group}, []string{"u5"}},
			{"state parked", parked.Filter{State: parked.StateParked}, []string{"u5", "u3", "u2", "u1"}},
			{"state archived", parked.Filter{State: parked.StateArchived}, []string{"u4"}},
			{"state replayed", parked.Filter{State: parked.StateReplayed}, nil},
			{"reason", parked.Filter{Reason: "card declined"}, []string{"u5"}},
			{"reason case", parked.Filter{Reason: "Card"}, []string{"u3"}},
			{"reason percent", parked.Filter{Reason: "100%"}, []string{"u1"}},
			{"reason underscore", parked.Filter{Reason: "card_x"}, []string{"u1"}},
			{"reason escape char", parked.Filter{Reason: "ss!"}, []string{"u4"}},
			{"reason percent alone", parked.Filter{Reason: "%"}, []string{"u1"}},
			{"uuid", parked.Filter{UUID: "u2"}, []string{"u2"}},
			{"key", parked.Filter{Key: "order:1"}, []string{"u4", "u1"}},
			{"since", parked.Filter{Since: base.Add(20 * time.Second)}, []string{"u5", "u4", "u3"}},
			{"until", parked.Filter{Until: base.Add(20 * time.Second)}, []string{"u2", "u1"}},
			{"window", parked.Filter{Since: base.Add(10 * time.Second), Until: base.Add(30 * time.Second)}, []string{"u3", "u2"}},
			{"and", parked.Filter{Handler: "charge", Topic: "orders", Key: "order:2"}, []string{"u2"}},
		} {
			var got []string
			for _, m := range e.all(t, c.f) {
				got = append(got, m.UUID)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("%s: List = %v, want %v", c.name, got, c.want)
			}
			if n, err := e.Count(t.Context(), c.f); err != nil || n != int64(len(c.want)) {
				t.Errorf("%s: Count = %d, %v; want %d", c.name, n, err, len(c.want))
			}
			pre, err := e.Preview(t.Context(), c.f, parked.ReplayOptions{})
			if err != nil || pre.Replayed+pre.Refused+pre.Skipped != int64(len(c.want)) {
				t.Errorf("%s: Preview = %+v, %v; want %d rows in all", c.name, pre, err, len(c.want))
			}
		}
		gs, err := e.Groups(t.Context(), parked.Filter{Handler: "ship", Outcome: settle.Poisoned})
		if err != nil || len(gs) != 1 || gs[0].ID != u5.Group || gs[0].Handler != "ship" || gs[0].Outcome != settle.Poisoned ||
			gs[0].Text != "card declined" || gs[0].ErrorType != "*errors.errorString" || gs[0].Parked != 1 || gs[0].Total != 1 ||
			!gs[0].LastSeen.Equal(base.Add(40*time.Second)) {
			t.Errorf("Groups of ship, poisoned = %+v, %v", gs, err)
		}
		if gs, _ := e.Groups(t.Context(), parked.Filter{}); len(gs) != 5 || !gs[0].LastSeen.After(gs[4].LastSeen) {
			t.Errorf("Groups = %+v; want 5, most recently seen first", gs)
		}
		// Bad filters and queries are refused, naming the field.
		for _, q := range []parked.Query{
			{Filter: parked.Filter{State: "gone"}},
			{Limit: 1001},
			{Limit: -1},
			{Cursor: "not a cursor"},
			{Filter: parked.Filter{IDs: make([]int64, 10001)}},
		} {
			if _, err := e.List(t.Context(), q); !errors.Is(err, parked.ErrInvalid) {
				t.Errorf("List(%+v) = %v, want an error wrapping ErrInvalid", q.Limit, err)
			}
		}
		if _, err := e.Preview(t.Context(), parked.Filter{State: "gone"}, parked.ReplayOptions{}); !errors.Is(err, parked.ErrInvalid) {
			t.Errorf("Preview of a bad state = %v, want an error wrapping ErrInvalid", err)
		}
	})
}

// Keyset pagination returns every row exactly once, in order, while other
// writers park new rows between the pages.
func TestPaginationWhileParking(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		base := time.Now().Add(-time.Hour)
		const n = 120
		for i := range n {
			p := parkedMsg("old-"+strconv.Itoa(i), "charge", errBoom)
			// Ties in last failure, so the id breaks them.
			p.LastFailure = base.Add(time.Duration(i/3) * time.Second)
			e.park(t, p)
		}
		w := e.another(t)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			// Bounded: a writer faster than the pages (SQLite, a page of
			// one row) would otherwise add rows ahead of the cursor for
			// ever, and the listing would never end (seen in CI: 19 min).
			for i := range 3 * n {
				select {
				case <-stop:
					return
				default:
				}
				p := parkedMsg("new-"+strconv.Itoa(i), "charge", errBoom)
				// New rows anywhere in time: before, among and after the old.
				p.LastFailure = base.Add(time.Duration(rand.IntN(120)-40) * time.Second)
				if err := w.Park(t.Context(), p); err != nil {
					t.Error(err)
					return
				}
			}
		})
		seen := map[string]int{}
		var prev *parked.Message
		q := parked.Query{Limit: 1 + rand.IntN(9)}
		for {
			page, err := e.List(t.Context(), q)
			if err != nil {
				t.Fatal(err)
			}
			for i := range page.Messages {
				m := page.Messages[i]
				seen[m.UUID]++
				if prev != nil && (m.LastFailure.After(prev.LastFailure) || m.LastFailure.Equal(prev.LastFailure) && m.ID >= prev.ID) {
					t.Errorf("row %d (%v) after row %d (%v): out of order", m.ID, m.LastFailure, prev.ID, prev.LastFailure)
				}
				prev = &m
			}
			if page.Next == "" {
				break
			}
			q.Cursor = page.Next
			time.Sleep(time.Millisecond)
		}
		close(stop)
		wg.Wait()
		for i := range n {
			if u := "old-" + strconv.Itoa(i); seen[u] != 1 {
				t.Errorf("%s seen %d times, want once", u, seen[u])
			}
		}
		for u, c := range seen {
			if c != 1 {
				t.Errorf("%s seen %d times", u, c)
			}
		}
	})
}

// The group counts follow every change of a row: park, park again,
// replay, archive, prune and purge; Prune and Purge never delete a parked
// row unless asked by name.
func TestLifecycleCounts(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		for i := range 12 {
			p := parkedMsg("m"+strconv.Itoa(i), "charge", fmt.Errorf("kind %c failed for %d", 'a'+rune(i%3), i))
			p.LastFailure = time.Now().Add(-time.Duration(12-i) * time.Minute)
			e.park(t, p)
			if i%4 == 0 {
				e.park(t, p) // again: no more counts
			}
		}
		e.checkGroups(t)
		count := func(f parked.Filter) int64 {
			n, err := e.Count(t.Context(), f)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
		if res, err := e.replay(t.Context(), parked.Filter{Reason: "kind a"}, parked.ReplayOptions{}); err != nil || res.Replayed != 4 {
			t.Fatalf("replay kind a: %+v, %v", res, err)
		}
		e.checkGroups(t)
		if n, err := e.Archive(t.Context(), parked.Filter{Reason: "kind b"}, "carol"); err != nil || n != 4 {
			t.Fatalf("Archive kind b = %d, %v", n, err)
		}
		if n, err := e.Archive(t.Context(), parked.Filter{Reason: "kind"}, "carol"); err != nil || n != 4 {
			t.Fatalf("Archive of every kind = %d, %v; want only the 4 still parked", n, err)
		}
		e.checkGroups(t)
		arch := e.all(t, parked.Filter{State: parked.StateArchived})
		if len(arch) != 8 || arch[0].ArchivedBy != "carol" || arch[0].ArchivedAt.IsZero() {
			t.Fatalf("archived rows: %+v", arch)
		}
		// Park more, then prune: the parked rows stay.
		for i := range 3 {
			e.park(t, parkedMsg("late"+strconv.Itoa(i), "charge", errBoom))
		}
		if n, err := e.Prune(t.Context(), time.Now().Add(-time.Hour)); err != nil || n != 0 {
			t.Fatalf("Prune of an hour ago = %d, %v; want nothing that old", n, err)
		}
		if n, err := e.Prune(t.Context(), time.Now().Add(time.Second)); err != nil || n != 12 {
			t.Fatalf("Prune = %d, %v; want the 12 replayed and archived rows", n, err)
		}
		if c := count(parked.Filter{}); c != 3 {
			t.Fatalf("%d rows after Prune, want the 3 parked", c)
		}
		e.checkGroups(t)
		if gs := e.groupsByID(t); len(gs) != 1 {
			t.Fatalf("groups after Prune: %+v; want the one with rows left", gs)
		}
		// Purge: Until is required; parked rows only by name.
		if _, err := e.Purge(t.Context(), parked.Filter{}); err == nil {
			t.Fatal("Purge without Until = nil error")
		}
		if n, err := e.Purge(t.Context(), parked.Filter{Until: time.Now().Add(time.Second)}); err != nil || n != 0 {
			t.Fatalf("Purge of every state but parked = %d, %v; want 0", n, err)
		}
		if n, err := e.Purge(t.Context(), parked.Filter{State: parked.StateParked, UUID: "late1", Until: time.Now().Add(time.Second)}); err != nil || n != 1 {
			t.Fatalf("Purge of parked late1 = %d, %v", n, err)
		}
		if c := count(parked.Filter{}); c != 2 {
			t.Fatalf("%d rows after Purge, want 2", c)
		}
		e.checkGroups(t)
	})
}

// Prune runs while replays and parks change rows: the counts stay right
// and no parked row is deleted.
func TestPruneRacingReplays(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		const n = 60
		for i := range n {
			e.park(t, parkedMsg("m"+strconv.Itoa(i), "charge", errBoom))
		}
		r := e.another(t)
		parked.SetChunk(r.api, 5)
		p := e.another(t)
		var wg sync.WaitGroup
		wg.Go(func() {
			if _, err := r.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{}); err != nil {
				t.Error(err)
			}
		})
		var pruned int64
		wg.Go(func() {
			for range 20 {
				n, err := p.Prune(t.Context(), time.Now().Add(time.Minute))
				if err != nil {
					t.Error(err)
					return
				}
				pruned += n
				time.Sleep(time.Millisecond)
			}
		})
		wg.Wait()
		n2, err := e.Prune(t.Context(), time.Now().Add(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		if pruned+n2 != n || len(e.outboxRows(t)) != n {
			t.Errorf("pruned %d+%d rows, %d outbox rows; want %d each", pruned, n2, len(e.outboxRows(t)), n)
		}
		e.checkGroups(t)
	})
}
