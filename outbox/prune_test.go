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
		db := e.db.DB
		cfg := outbox.RelayConfig{PollInterval: 5 * time.Millisecond}
		for i := range 5 {
			e.placeOrder(t, ctx, "F-"+string(rune('0'+i)), true, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
		}
		if n, err := e.ob.Forward(ctx, db, e.pubsub, cfg); err != nil || n != 5 {
			t.Fatalf("Forward = %d, %v", n, err)
		}
		e.placeOrder(t, ctx, "P-1", true, message.NewMessage("pending", []byte(`{}`)))

		n, err := e.ob.Prune(ctx, db, time.Hour)
		if err != nil || n != 0 {
			t.Fatalf("Prune(older than an hour) = %d, %v; want nothing that young deleted", n, err)
		}
		n, err = e.ob.Prune(ctx, db, 0)
		if err != nil || n != 5 {
			t.Fatalf("Prune(0) = %d, %v; want the 5 forwarded rows", n, err)
		}
		if st, err := e.ob.Status(ctx, db); err != nil || st.Pending != 1 {
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
		if n, err := e.ob.Forward(ctx, db, e.pubsub, cfg); err != nil || n != 1 {
			t.Fatalf("Forward after prune = %d, %v; want the pending row", n, err)
		}
		for m := range got {
			m.Ack()
			if m.UUID == "pending" {
				break
			}
		}
		if _, err := e.ob.Prune(ctx, db, -time.Second); err == nil {
			t.Fatal("Prune with a negative age succeeded")
		}
	})
}

func quoteTable(e *env, name string) string {
	if e.db.Dialect == "mysql" {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}
