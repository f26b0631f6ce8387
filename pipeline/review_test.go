package pipeline_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
)

// review: a transactional handler in the default mode (the dedupe
// middleware's claim, confirmed in the transaction) at REPEATABLE READ or
// SERIALIZABLE, whose transaction outlives one renewal of its claim. The
// renewal, on another connection, updates the claim's row after the
// transaction's snapshot; PostgreSQL then refuses the confirmation in the
// transaction as a serialization failure, every time, for a claim that was
// never lost: the delivery is deferred (not an attempt), comes back, and
// fails the same way for ever. The handler must succeed and its effect
// commit once.
func TestReviewLongTxAtRepeatableReadConfirms(t *testing.T) {
	t.Parallel()
	for _, lv := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(lv.String(), func(t *testing.T) {
			t.Parallel()
			// SQLite has one isolation level, and HoldTx renews inside the
			// transaction.
			onServers(t,
				func(t *testing.T, d db[*sql.Tx]) { longTxAtIsolationConfirms(t, d, lv) },
				func(t *testing.T, d db[pgx.Tx]) { longTxAtIsolationConfirms(t, d, lv) })
		})
	}
}

func longTxAtIsolationConfirms[TTx any](t *testing.T, d db[TTx], lv sql.IsolationLevel) {
	e := newTxEnv(t, d)
	mw, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 900 * time.Millisecond, RenewInterval: 200 * time.Millisecond})
	must(t, err)
	runs := 0
	handler, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, TxOptions: &sql.TxOptions{Isolation: lv}},
		func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
			runs++
			var n int
			if err := d.Tx(tx).QueryRow(ctx, "SELECT COUNT(*) FROM "+e.charges, nil, &n); err != nil {
				return err // the snapshot is taken here
			}
			time.Sleep(700 * time.Millisecond) // three renewals
			_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+d.ph(1)+", 100)", msg.UUID)
			return err
		})
	must(t, err)
	h := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.SetContext(t.Context())
	var lastErr error
	for range 3 {
		if _, lastErr = h(msg); lastErr == nil {
			break
		}
	}
	if lastErr != nil || e.rows(t) != 1 || runs != 1 {
		t.Errorf("after %d runs: %v; %d effect rows, want the handler done once", runs, lastErr, e.rows(t))
	}
	confirmedOnce(t, e.store, msg.UUID)
}

// confirmedOnce requires key to be confirmed after one attempt.
func confirmedOnce(t *testing.T, store dedupe.Store, key string) {
	t.Helper()
	c, err := store.Claim(t.Context(), key, time.Minute)
	must(t, err)
	if c.Result != dedupe.Duplicate || c.Attempt != 1 {
		t.Errorf("key %s: %v after %d attempts, want confirmed after 1", key, c.Result, c.Attempt)
	}
}
