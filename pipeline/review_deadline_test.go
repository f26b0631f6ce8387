package pipeline_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// review: in the default mode (the dedupe middleware in front), TxConfig's
// doc says the handler's function "runs as long as it takes": only
// settle's own calls get CallTimeout. On PostgreSQL, though, the
// transaction sets idle_in_transaction_session_timeout to 2*CallTimeout
// and lock_timeout to CallTimeout/2 for itself, and these bound the
// handler's own work: a handler that calls a slow service between two
// statements (longer than 2*CallTimeout) has its session terminated by the
// server, and one whose statement waits for a row lock longer than
// CallTimeout/2 fails. Both must commit their effect once.
func TestReviewDefaultModeHandlerOutlivesCallTimeout(t *testing.T) {
	t.Skip("review: on PostgreSQL the default mode's handler is bounded by the transaction's lock_timeout (CallTimeout/2: its own statement waiting on a lock fails, an attempt) and idle_in_transaction_session_timeout (2*CallTimeout: the server ends its session, rerun then deferred for ever), not yet fixed")
	t.Parallel()
	for _, d := range testenv.Databases() {
		if d.Name != "postgres" {
			continue
		}
		t.Run("idle/"+d.Name, func(t *testing.T) {
			t.Parallel()
			e := newTxEnv(t, d.Open(t))
			const callTimeout = 300 * time.Millisecond
			mw, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second})
			must(t, err)
			h, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Store: e.store, CallTimeout: callTimeout},
				func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
					if _, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+e.ph(1)+", 1)", msg.UUID); err != nil {
						return err
					}
					time.Sleep(6 * callTimeout) // a slow payment service
					_, err := tx.ExecContext(ctx, "UPDATE "+e.charges+" SET cents = 2 WHERE order_id = "+e.ph(1), msg.UUID)
					return err
				})
			must(t, err)
			handler := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
			msg := message.NewMessage(watermill.NewUUID(), nil)
			msg.SetContext(t.Context())
			if _, err := handler(msg); err != nil {
				t.Fatalf("a handler slower than 2*CallTimeout between its statements failed: %v", err)
			}
			if n := e.rows(t); n != 1 {
				t.Fatalf("%d charges, want 1", n)
			}
		})
		t.Run("lock/"+d.Name, func(t *testing.T) {
			t.Parallel()
			e := newTxEnv(t, d.Open(t))
			const callTimeout = 300 * time.Millisecond
			_, err := e.db.ExecContext(t.Context(), "INSERT INTO "+e.charges+" (order_id, cents) VALUES ('shared', 0)")
			must(t, err)
			// Another transaction holds the row for a while, then commits.
			other, err := e.db.BeginTx(t.Context(), nil)
			must(t, err)
			_, err = other.ExecContext(t.Context(), "UPDATE "+e.charges+" SET cents = cents + 1 WHERE order_id = 'shared'")
			must(t, err)
			time.AfterFunc(4*callTimeout, func() { _ = other.Commit() })
			mw, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second})
			must(t, err)
			h, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Store: e.store, CallTimeout: callTimeout},
				func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
					_, err := tx.ExecContext(ctx, "UPDATE "+e.charges+" SET cents = cents + 10 WHERE order_id = 'shared'")
					return err
				})
			must(t, err)
			handler := mw(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
			msg := message.NewMessage(watermill.NewUUID(), nil)
			msg.SetContext(t.Context())
			if _, err := handler(msg); err != nil {
				t.Fatalf("a handler waiting on a row lock longer than CallTimeout/2 failed: %v", err)
			}
			var cents int
			must(t, e.db.QueryRowContext(t.Context(), "SELECT cents FROM "+e.charges+" WHERE order_id = 'shared'").Scan(&cents))
			if cents != 11 {
				t.Fatalf("cents = %d, want 11", cents)
			}
		})
	}
}

// review: a CallTimeout or Config.StoreTimeout no database answers within
// (1ns, 1µs) is refused by name: accepted, it deferred every delivery for
// ever without a run.
func TestReviewTinyCallTimeoutRefused(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for _, d := range []time.Duration{time.Nanosecond, time.Microsecond, 9 * time.Millisecond} {
		_, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: db.DB, CallTimeout: d}, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil })
		if err == nil || !strings.Contains(err.Error(), "TxConfig.CallTimeout") {
			t.Errorf("CallTimeout %v: %v; want it refused by name", d, err)
		}
		if err := (pipeline.Config{Publisher: gochannel.NewGoChannel(gochannel.Config{}, nil), StoreTimeout: d}).Validate(); err == nil || !strings.Contains(err.Error(), "StoreTimeout") {
			t.Errorf("Config.StoreTimeout %v: %v; want it refused by name", d, err)
		}
	}
}
