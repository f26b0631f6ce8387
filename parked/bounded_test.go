package parked_test

import (
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/settle-go/settle/parked"
)

// A page whose filter no index answers in order reads a bounded number of
// rows: a text that matches only old rows gives short (even empty) pages
// with a Next, and following Next finds every match once, in order.
func TestListBoundsTheRowsAPageReads(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		const scan = 7
		parked.SetListScan(e.api, scan)
		base := time.Now().Add(-time.Hour)
		const n = 60
		// Rows i = 0 (oldest) .. n-1 (newest) of handler charge; the
		// needles are all further back than one page reads.
		needle := map[int]bool{0: true, 1: true, 17: true, 30: true, n - 1 - 2*scan: true}
		for i := range n {
			cause := errors.New("timeout talking to the bank")
			if needle[i] {
				cause = fmt.Errorf("card %d declined: needle", i)
			}
			p := parkedMsg("m-"+strconv.Itoa(i), "charge", cause)
			p.LastFailure = base.Add(time.Duration(i) * time.Second)
			e.park(t, p)
			other := parkedMsg("o-"+strconv.Itoa(i), "email", fmt.Errorf("mail %d: needle", i))
			other.LastFailure = p.LastFailure
			e.park(t, other)
		}
		for _, f := range []parked.Filter{
			{Handler: "charge", Reason: "needle"},
			{Handler: "charge", Reason: "needle", State: parked.StateParked},
		} {
			q := parked.Query{Filter: f, Limit: 2}
			var got []string
			pages, short := 0, 0
			var prev time.Time
			for {
				page, err := e.List(t.Context(), q)
				if err != nil {
					t.Fatal(err)
				}
				pages++
				if len(page.Messages) > q.Limit {
					t.Fatalf("page of %d rows, limit %d", len(page.Messages), q.Limit)
				}
				if len(page.Messages) < q.Limit && page.Next != "" {
					short++
				}
				if pages == 1 && (len(page.Messages) != 0 || page.Next == "") {
					t.Fatalf("first page: %d rows, next %q; want none and a next (the first match is %d rows back, a page reads %d)",
						len(page.Messages), page.Next, 2*scan+1, scan)
				}
				for _, m := range page.Messages {
					if !prev.IsZero() && !m.LastFailure.Before(prev) {
						t.Errorf("%s out of order", m.UUID)
					}
					prev = m.LastFailure
					got = append(got, m.UUID)
				}
				if page.Next == "" {
					break
				}
				if pages > n {
					t.Fatal("pages never end")
				}
				q.Cursor = page.Next
			}
			want := []string{"m-" + strconv.Itoa(n-1-2*scan), "m-30", "m-17", "m-1", "m-0"}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("%+v: rows %v, want %v", f, got, want)
			}
			if short == 0 {
				t.Errorf("%+v: no short page: the bound was not applied", f)
			}
		}
		// One indexed filter alone gives full pages.
		page, err := e.List(t.Context(), parked.Query{Filter: parked.Filter{Handler: "charge"}, Limit: 20})
		if err != nil || len(page.Messages) != 20 {
			t.Fatalf("handler only: %d rows, %v; want 20", len(page.Messages), err)
		}
	})
}
