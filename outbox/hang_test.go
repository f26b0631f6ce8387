package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// A row whose publish never returns overruns its batch's AckDeadline each
// time it is tried. It must not hold the rows behind it: each of them is
// forwarded, once, while the hanging row waits, and the hanging row is set
// aside at its MaxAttempts-th overrun. RetryInterval and MaxRetryInterval
// are a millisecond, so that the hanging row's backoff is no longer than
// the relay's pause after the overrun: it is due again by the next batch,
// first in offset order (before the fix, every batch began with it and
// overran, and no row behind it ever left).
func TestHangingRowDoesNotStallTheRowsBehindIt(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		const good, maxAttempts = 60, 3
		msgs := []*message.Message{message.NewMessage("hang", []byte(`{}`))}
		for i := range good {
			msgs = append(msgs, message.NewMessage(fmt.Sprintf("good-%02d", i), []byte(`{}`)))
		}
		e.publishTx(t, "orders", msgs...) // one transaction: the hanging row has the lowest offset
		// AckDeadline is long enough for a batch of good rows on a loaded
		// machine (a good batch that overran would publish its rows twice).
		r := startRelay(t, e, hangs{e.pubsub}, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 10,
			AckDeadline: 2 * time.Second, RetryInterval: time.Millisecond, MaxRetryInterval: time.Millisecond, MaxAttempts: maxAttempts})

		seen := map[string]int{}
		deadline := time.After(2 * time.Minute)
		for len(seen) < good {
			select {
			case m := <-got:
				m.Ack()
				seen[m.UUID]++
			case <-deadline:
				rows, _ := e.ob.Failed(t.Context(), outbox.Selection{})
				t.Fatalf("%d of %d rows behind the hanging one forwarded in 2 minutes; failed rows: %+v", len(seen), good, rows)
			}
		}
		// The hanging row is set aside at its MaxAttempts-th overrun, not
		// later, without any row written after it.
		var rows []outbox.FailedRow
		for wait := time.Now().Add(time.Minute); ; {
			rows, err = e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) > 0 || time.Now().After(wait) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if len(rows) != 1 || rows[0].UUID != "hang" || rows[0].Attempts != maxAttempts || !strings.Contains(rows[0].LastError, "AckDeadline") {
			all, _ := e.ob.Failed(t.Context(), outbox.Selection{})
			t.Fatalf("set aside: %+v (all failed rows: %+v); want the hanging row alone, after %d attempts, its error naming AckDeadline", rows, all, maxAttempts)
		}
		// The last batch's marks commit after its rows were published.
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		if err := r.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		if st, err := e.ob.Status(t.Context()); err != nil || st.Pending != 0 || st.SetAside != 1 {
			t.Fatalf("Status = %+v, %v; want nothing pending and one row set aside", st, err)
		}
		// Each good row went out once: none was in a batch that overran
		// after publishing it.
		time.Sleep(200 * time.Millisecond)
		for {
			select {
			case m := <-got:
				m.Ack()
				seen[m.UUID]++
				continue
			default:
			}
			break
		}
		for id, n := range seen {
			if n != 1 || !strings.HasPrefix(id, "good-") {
				t.Fatalf("%s delivered %d times; want each good row once, and never the hanging row", id, n)
			}
		}
	})
}
