package dedupe_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// A handler succeeds, and the claims table is gone before its claim is
// confirmed (renamed away for 300ms, as by a migration or a failover). The
// delivery must not fail: nacked, it would come back once the claim had
// expired and run the handler a second time. It is held until the store
// answers and then acked, confirmed; a redelivery is a duplicate.
func TestConfirmOutlastsAStoreOutage(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		open func(testing.TB) testenv.DB
	}{{"sqlite", testenv.SQLite}, {"postgres", testenv.Postgres}, {"mysql", testenv.MySQL}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := c.open(t)
			table := testenv.DedupeTable(t, db)
			store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			rename := func(from, to string) {
				if _, err := db.ExecContext(context.Background(), "ALTER TABLE "+from+" RENAME TO "+to); err != nil {
					t.Errorf("rename %s: %v", from, err)
				}
			}
			away := table + "_away"
			var runs atomic.Int32
			back := make(chan struct{})
			h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 100 * time.Millisecond, RenewInterval: 30 * time.Millisecond})(
				func(msg *message.Message) ([]*message.Message, error) {
					if runs.Add(1) == 1 {
						rename(table, away) // the effect is done; now the store goes
						time.AfterFunc(300*time.Millisecond, func() { rename(away, table); close(back) })
					}
					return nil, nil
				})
			uuid := watermill.NewUUID()
			start := time.Now()
			if _, err := h(newMsg(t, uuid)); err != nil {
				t.Fatalf("delivery failed after its handler succeeded: %v", err)
			}
			<-back
			if took := time.Since(start); took < 300*time.Millisecond {
				t.Errorf("acked after %v, before the store was back", took)
			}
			if _, err := h(newMsg(t, uuid)); err != nil {
				t.Fatal(err)
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("handler ran %d times, want once", n)
			}
			key, err := dedupe.MessageKey(newMsg(t, uuid), nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			claim, err := store.Claim(t.Context(), key, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if claim.Result != dedupe.Duplicate {
				t.Errorf("the key is %v after the outage, want confirmed (duplicate)", claim.Result)
			}
		})
	}
}
