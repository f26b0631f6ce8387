package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// NewTxHandler behind the dedupe middleware, as its documentation shows,
// with Batch or OneStatement turned on (which claim keys themselves): the
// middleware's claims are used, confirmed in the transaction. Before, the
// transaction's own claim found the middleware's and deferred every
// delivery, forever. A failing message is retried alone and a redelivered
// one is a duplicate.
func TestTxHandlerBehindDedupeMiddleware(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{true, false} {
		name := "one-statement"
		if batch {
			name = "batch"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			onEachDriver(t,
				func(t *testing.T, d db[*sql.Tx]) { behindDedupeMiddleware(t, d, batch) },
				func(t *testing.T, d db[pgx.Tx]) { behindDedupeMiddleware(t, d, batch) })
		})
	}
}

func behindDedupeMiddleware[TTx any](t *testing.T, d db[TTx], batch bool) {
	e := newTxEnv(t, d)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second,
		BusyDelay: time.Millisecond})
	must(t, err)
	cfg := pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob, Store: e.store, BusyDelay: time.Millisecond}
	if batch {
		cfg.Batch = pipeline.BatchConfig{MaxSize: 4, MaxWait: 20 * time.Millisecond}
	} else {
		cfg.OneStatement = true
	}
	declined := errors.New("card declined")
	var calls sync.Map // message UUID -> *atomic.Int64
	charge := e.charge(nil)
	h, err := pipeline.NewTxHandler(cfg, func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
		n, _ := calls.LoadOrStore(msg.UUID, new(atomic.Int64))
		if n.(*atomic.Int64).Add(1) == 1 && msg.UUID == "mw-2" {
			return declined
		}
		return charge(ctx, tx, msg, out)
	})
	must(t, err)
	stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	handle := func(m *message.Message) error { _, err := stack(m); return err }
	onlyFailed(t, deliverAll(handle, orders(4, "mw")), "mw", 2, declined)
	if n := e.rows(t); n != 3 {
		t.Fatalf("charges=%d after the first delivery, want 3 (mw-2 failed alone)", n)
	}
	// The broker delivers all four again: mw-2 does its work, the others
	// are duplicates.
	onlyFailed(t, deliverAll(handle, orders(4, "mw")), "mw", -1, nil)
	if n := e.rows(t); n != 4 {
		t.Fatalf("charges=%d after the redelivery, want 4", n)
	}
	confirmedAfter(t, e.store, "mw", 4, 2)
}

// onlyFailed requires that the delivery of prefix-failed (none when -1)
// failed with want and that the others succeeded.
func onlyFailed(t *testing.T, errs []error, prefix string, failed int, want error) {
	t.Helper()
	for i, err := range errs {
		if (i == failed && !errors.Is(err, want)) || (i != failed && err != nil) {
			t.Fatalf("delivery of %s-%d: %v", prefix, i, err)
		}
	}
}

// confirmedAfter requires the keys prefix-0 … prefix-(n-1) confirmed in
// store, each on its first attempt but prefix-failed's, on its second (a
// rolled-back run of a batch is no attempt of the others).
func confirmedAfter(t *testing.T, store dedupe.Store, prefix string, n, failed int) {
	t.Helper()
	for i := range n {
		id := fmt.Sprintf("%s-%d", prefix, i)
		c, err := store.Claim(t.Context(), id, time.Minute)
		must(t, err)
		want := 1
		if i == failed {
			want = 2
		}
		if c.Result != dedupe.Duplicate || c.Attempt != want {
			t.Errorf("%s's key: %v after %d attempts, want confirmed after %d", id, c.Result, c.Attempt, want)
		}
	}
}

// A batch function that returns MessageFailed(i, err) with a nil err (a
// loop that names its message but whose error variable is nil, for
// instance). The run is rolled back, and the named message is settled with
// that nil "error": it is acked as done although its work never committed
// and its key was never confirmed. Nothing acked that was not done.
func TestBatchMessageFailedWithNilErrorIsAFailure(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchMessageFailedWithNilErrorIsAFailure[*sql.Tx], batchMessageFailedWithNilErrorIsAFailure[pgx.Tx])
}

func batchMessageFailedWithNilErrorIsAFailure[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	var reason error // nil: the check below found nothing wrong with the message
	h, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msgs []*message.Message, _ message.Publisher) error {
			if err := e.insertAll(ctx, tx, msgs); err != nil {
				return err
			}
			for i, m := range msgs {
				if m.UUID == "mf-1" {
					return pipeline.MessageFailed(i, reason)
				}
			}
			return nil
		})
	must(t, err)
	errs := deliverAll(h, orders(4, "mf"))
	c, err := e.store.Claim(t.Context(), "mf-1", time.Minute)
	must(t, err)
	if errs[1] == nil && (e.rows(t) != 4 || c.Result != dedupe.Duplicate) {
		t.Fatalf("mf-1 acked (nil result), but charges=%d and its key is %v: acked without its work", e.rows(t), c.Result)
	}
}

// SQLite, a batched NewTxHandler behind the dedupe middleware, handlers
// that together take longer than the middleware's ClaimTimeout: every claim
// is held by the batch's transaction before the first handler runs (after
// which the middleware's renewals could not land), so every delivery
// commits once, in one run. Before, the later claims expired while the
// earlier handlers ran.
func TestSQLiteBatchBehindMiddlewareKeepsLongClaims(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, stdOf(testenv.SQLite(t)))
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 300 * time.Millisecond,
		BusyDelay: time.Millisecond})
	must(t, err)
	var calls atomic.Int64
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Store: e.store, BusyDelay: time.Millisecond,
		Batch: pipeline.BatchConfig{MaxSize: 3, MaxWait: 100 * time.Millisecond}},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			calls.Add(1)
			time.Sleep(250 * time.Millisecond) // a long handler: most of the claim timeout
			_, err := e.db.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES (?, 1)", msg.UUID)
			return err
		})
	must(t, err)
	stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	handle := func(m *message.Message) error { _, err := stack(m); return err }
	errs := deliverAll(handle, orders(3, "sl"))
	for i, err := range errs {
		if err != nil {
			t.Errorf("sl-%d: %v", i, err)
		}
	}
	if n, c := e.rows(t), calls.Load(); n != 3 || c != 3 {
		t.Fatalf("charges=%d handler calls=%d; want 3 charges from 3 calls (one run of the batch)", n, c)
	}
}

// PostgreSQL: the claims table goes away (renamed) after the middleware
// claimed the batch's keys and before the batch confirms them. That is the
// store's outage, not a failure of any handler: without the middleware the
// batch defers every delivery (ErrUnavailable, no attempt) when its claims
// fail, and so it must behind the middleware. Before, each confirmation
// failed in turn as that message's handler error, and the batch re-ran the
// rest each time.
func TestBatchBehindMiddlewareDefersAStoreOutage(t *testing.T) {
	t.Parallel()
	onPostgres(t, batchBehindMiddlewareDefersAStoreOutage[*sql.Tx], batchBehindMiddlewareDefersAStoreOutage[pgx.Tx])
}

func batchBehindMiddlewareDefersAStoreOutage[TTx any](t *testing.T, d db[TTx]) {
	admin := testenv.Postgres(t)
	e := newTxEnv(t, d)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second,
		BusyDelay: time.Millisecond, UnavailableDelay: time.Millisecond, SettleTimeout: 200 * time.Millisecond})
	must(t, err)
	var calls atomic.Int64
	renamed := false
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Store: e.store, BusyDelay: time.Millisecond,
		Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 100 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
			if calls.Add(1) == 1 {
				_, err := admin.ExecContext(ctx, `ALTER TABLE "`+e.claims+`" RENAME TO "`+e.claims+`_x"`)
				must(t, err)
				renamed = true
			}
			_, err := e.db.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 1)", msg.UUID)
			return err
		})
	must(t, err)
	t.Cleanup(func() {
		if renamed {
			_, _ = admin.ExecContext(context.Background(), `ALTER TABLE "`+e.claims+`_x" RENAME TO "`+e.claims+`"`)
		}
	})
	stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	handle := func(m *message.Message) error { _, err := stack(m); return err }
	errs := deliverAll(handle, orders(4, "co"))
	var notDeferred int
	for i, err := range errs {
		if !errors.Is(err, dedupe.ErrUnavailable) {
			notDeferred++
			t.Logf("co-%d: %v", i, err)
		}
	}
	if c := calls.Load(); notDeferred > 0 || c > 4 {
		t.Fatalf("%d of 4 deliveries failed as handler errors (not deferred as ErrUnavailable), %d handler calls for 4 messages; "+
			"want all deferred, handlers run once", notDeferred, c)
	}
}

// The per-message twin of TestBatchBehindMiddlewareDefersAStoreOutage, in
// the default mode and with OneStatement: the claims table goes away while
// the handler runs, so the confirmation in its transaction fails. The
// delivery is deferred (the store's outage), and once the table is back (and
// the claim it could not release has expired) its redelivery does the work
// once. Before, the failure was the handler's: a spent attempt.
func TestTxHandlerBehindMiddlewareDefersAStoreOutage(t *testing.T) {
	t.Parallel()
	onPostgres(t, txHandlerBehindMiddlewareDefersAStoreOutage[*sql.Tx], txHandlerBehindMiddlewareDefersAStoreOutage[pgx.Tx])
}

func txHandlerBehindMiddlewareDefersAStoreOutage[TTx any](t *testing.T, d db[TTx]) {
	for _, one := range []bool{false, true} {
		t.Run(fmt.Sprintf("one-statement=%v", one), func(t *testing.T) {
			admin := testenv.Postgres(t)
			e := newTxEnv(t, d)
			dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 500 * time.Millisecond,
				BusyDelay: time.Millisecond, UnavailableDelay: time.Millisecond, SettleTimeout: 200 * time.Millisecond})
			must(t, err)
			rename := func(from, to string) {
				_, err := admin.ExecContext(context.Background(), `ALTER TABLE "`+from+`" RENAME TO "`+to+`"`)
				must(t, err)
			}
			var calls atomic.Int64
			h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Store: e.store, OneStatement: one, BusyDelay: time.Millisecond},
				func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
					if calls.Add(1) == 1 {
						rename(e.claims, e.claims+"_x")
					}
					_, err := e.db.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 1)", msg.UUID)
					return err
				})
			must(t, err)
			stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
			if _, err := stack(message.NewMessage("so-1", []byte("so-1"))); !errors.Is(err, dedupe.ErrUnavailable) {
				t.Fatalf("delivery during the outage: %v, want it deferred (dedupe.ErrUnavailable)", err)
			}
			rename(e.claims+"_x", e.claims)
			// The claim could not be released during the outage: the
			// redeliveries are deferred as busy until it expires.
			deadline := time.Now().Add(10 * time.Second)
			for {
				_, err := stack(message.NewMessage("so-1", []byte("so-1")))
				if err == nil {
					break
				}
				if !errors.Is(err, dedupe.ErrBusy) || time.Now().After(deadline) {
					t.Fatalf("redelivery after the outage: %v", err)
				}
				time.Sleep(50 * time.Millisecond)
			}
			if n := e.rows(t); n != 1 || calls.Load() != 2 {
				t.Fatalf("charges=%d after %d handler calls, want 1 charge", n, calls.Load())
			}
		})
	}
}
