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
	"github.com/settle-go/settle/internal/testenv"
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
		for _, d := range testenv.Databases() {
			if d.Name == "sqlite" {
				continue // one isolation level, and HoldTx renews inside the transaction
			}
			t.Run(lv.String()+"/"+d.Name, func(t *testing.T) {
				t.Parallel()
				e := newTxEnv(t, d.Open(t))
				mw, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 900 * time.Millisecond, RenewInterval: 200 * time.Millisecond})
				must(t, err)
				// Store as Pipeline.HandleTx sets it: on PostgreSQL each
				// transaction then sets its server-side timeouts first.
				cfg := pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Store: e.store, TxOptions: &sql.TxOptions{Isolation: lv}}
				runs := 0
				h := mw(func(msg *message.Message) ([]*message.Message, error) {
					return nil, pipeline.RunTx(msg.Context(), cfg, msg, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
						runs++
						var n int
						if err := tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+e.charges).Scan(&n); err != nil {
							return err // the snapshot is taken here
						}
						time.Sleep(700 * time.Millisecond) // three renewals
						_, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+e.db.ph(1)+", 100)", msg.UUID)
						return err
					})
				})
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
			})
		}
	}
}

// review: the same on pgx (NewPgxTxHandler, dedupe.PgxStore).
func TestReviewLongPgxTxAtRepeatableReadConfirms(t *testing.T) {
	t.Parallel()
	for _, lv := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(lv), func(t *testing.T) {
			t.Parallel()
			pool := testenv.PgxPool(t)
			e := newTxEnv(t, stdOf(testenv.Postgres(t)))
			store, err := dedupe.NewPgxStore(pool, dedupe.PgxConfig{Table: e.claims})
			must(t, err)
			mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: 900 * time.Millisecond, RenewInterval: 200 * time.Millisecond})
			must(t, err)
			handler, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: pool, TxOptions: pgx.TxOptions{IsoLevel: lv}},
				func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ message.Publisher) error {
					var n int
					if err := tx.QueryRow(ctx, "SELECT COUNT(*) FROM "+e.charges).Scan(&n); err != nil {
						return err
					}
					time.Sleep(700 * time.Millisecond)
					_, err := tx.Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 100)", msg.UUID)
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
			if lastErr != nil || e.rows(t) != 1 {
				t.Errorf("%v; %d effect rows, want the handler done once", lastErr, e.rows(t))
			}
			confirmedOnce(t, store, msg.UUID)
		})
	}
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
