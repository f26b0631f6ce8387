package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// Prune deletes forwarded rows only: pending rows stay, and forwarding goes
// on afterwards.
func TestPruneDeletesForwardedRowsOnly(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := t.Context()
		cfg := outbox.RelayConfig{PollInterval: 5 * time.Millisecond}
		for i := range 5 {
			e.placeOrder(t, ctx, "F-"+string(rune('0'+i)), true, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
		}
		if n, err := e.ob.Forward(ctx, e.pubsub, cfg); err != nil || n != 5 {
			t.Fatalf("Forward = %d, %v", n, err)
		}
		e.placeOrder(t, ctx, "P-1", true, message.NewMessage("pending", []byte(`{}`)))

		n, err := e.ob.Prune(ctx, time.Now().Add(-time.Hour))
		if err != nil || n != 0 {
			t.Fatalf("Prune(an hour ago) = %d, %v; want nothing that young deleted", n, err)
		}
		n, err = e.ob.Prune(ctx, time.Now())
		if err != nil || n != 5 {
			t.Fatalf("Prune(now) = %d, %v; want the 5 forwarded rows", n, err)
		}
		if st, err := e.ob.Status(ctx); err != nil || st.Pending != 1 {
			t.Fatalf("status after prune = %+v, %v; want the pending row kept", st, err)
		}
		var rows int
		if err := e.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+quoteTable(e, e.ob.Table())).Scan(&rows); err != nil || rows != 1 {
			t.Fatalf("%d rows left, %v; want the pending one", rows, err)
		}
		got, err := e.pubsub.Subscribe(ctx, "orders.placed")
		if err != nil {
			t.Fatal(err)
		}
		if n, err := e.ob.Forward(ctx, e.pubsub, cfg); err != nil || n != 1 {
			t.Fatalf("Forward after prune = %d, %v; want the pending row", n, err)
		}
		for m := range got {
			m.Ack()
			if m.UUID == "pending" {
				break
			}
		}
		// A cut-off in the future prunes every forwarded row, none pending.
		e.placeOrder(t, ctx, "P-2", true, message.NewMessage("pending-2", []byte(`{}`)))
		if n, err := e.ob.Prune(ctx, time.Now().Add(time.Hour)); err != nil || n != 1 {
			t.Fatalf("Prune(an hour from now) = %d, %v; want the one forwarded row", n, err)
		}
		if st, err := e.ob.Status(ctx); err != nil || st.Pending != 1 {
			t.Fatalf("status after prune = %+v, %v; want the pending row kept", st, err)
		}
	})
}

func quoteTable(e *env, name string) string {
	if e.db.Dialect == "mysql" {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}
