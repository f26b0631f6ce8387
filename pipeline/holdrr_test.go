package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// rrWorker is one consumer of a zombie test: its own dedupe middleware on
// the shared claims table, in front of a transactional handler at iso.
type rrWorker struct {
	h    message.HandlerFunc
	runs atomic.Int64
}

func newRRWorker(t *testing.T, e *txEnv[*sql.Tx], iso sql.IsolationLevel, fn func(ctx context.Context, tx *sql.Tx, msg *message.Message) error) *rrWorker {
	t.Helper()
	mw, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 600 * time.Millisecond,
		RenewInterval: 150 * time.Millisecond, StoreTimeout: time.Second, BusyDelay: settle.NoDelay, UnavailableDelay: settle.NoDelay})
	must(t, err)
	w := &rrWorker{}
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Store: e.store, TxOptions: &sql.TxOptions{Isolation: iso},
		BusyDelay: 10 * time.Millisecond},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			w.runs.Add(1)
			if err := fn(ctx, tx, msg); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 100)", msg.UUID)
			return err
		})
	must(t, err)
	w.h = mw(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	return w
}

// deliver hands w a copy of msg, as a redelivery would.
func (w *rrWorker) deliver(ctx context.Context, msg *message.Message) error {
	m := message.NewMessage(msg.UUID, msg.Payload)
	m.SetContext(ctx)
	_, err := w.h(m)
	return err
}

// A handler's transaction at REPEATABLE READ or SERIALIZABLE on PostgreSQL
// holds its claim's row from its first statement (dedupe.HoldTx), and no
// longer renews it beside the transaction. Worker A's transaction stalls,
// as a zombie's would, three times past the claim timeout; worker B gets
// the same message meanwhile, again and again. B's claim waits on A's lock
// and never takes the key over, however expired its committed claim is:
// its deliveries are deferred (not run), A commits its effect, and B's
// next delivery is a duplicate. One effect, B's handler never run.
func TestLongTxAtRepeatableReadHoldsOffTakeover(t *testing.T) {
	t.Parallel()
	for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(iso.String(), func(t *testing.T) {
			t.Parallel()
			e := newTxEnv(t, stdOf(testenv.Postgres(t)))
			holding := make(chan struct{})
			a := newRRWorker(t, e, iso, func(ctx context.Context, tx *sql.Tx, msg *message.Message) error {
				var n int
				if err := tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+e.charges).Scan(&n); err != nil {
					return err // the snapshot is taken here, if not by the hold
				}
				close(holding)
				time.Sleep(1800 * time.Millisecond) // three claim timeouts, no renewal
				return nil
			})
			b := newRRWorker(t, e, iso, func(context.Context, *sql.Tx, *message.Message) error { return nil })
			msg := message.NewMessage(watermill.NewUUID(), nil)
			aDone := make(chan error, 1)
			go func() { aDone <- a.deliver(t.Context(), msg) }()
			<-holding
			deferred := 0
			var aErr error
		loop:
			for {
				select {
				case aErr = <-aDone:
					break loop
				default:
				}
				err := b.deliver(t.Context(), msg)
				if err == nil {
					// A duplicate: B's claim waited for A's commit.
					aErr = <-aDone
					break loop
				}
				if !errors.Is(err, dedupe.ErrUnavailable) && !errors.Is(err, dedupe.ErrBusy) {
					t.Fatalf("B's delivery: %v, want it deferred", err)
				}
				deferred++
			}
			if aErr != nil {
				t.Fatalf("A: %v", aErr)
			}
			if err := b.deliver(t.Context(), msg); err != nil {
				t.Fatalf("B after A committed: %v, want a duplicate", err)
			}
			if n := e.rows(t); n != 1 || a.runs.Load() != 1 || b.runs.Load() != 0 || deferred == 0 {
				t.Fatalf("%d effect rows, A ran %d, B ran %d, B deferred %d times; want one effect, A's, B deferred and never run",
					n, a.runs.Load(), b.runs.Load(), deferred)
			}
			confirmedOnce(t, e.store, msg.UUID)
		})
	}
}

// The zombie's transaction ends under it (the server terminates its
// session, as idle_in_transaction_session_timeout does for a stopped
// process): only then can B take the key over, and B does the work. A,
// woken, cannot do it again: its transaction is gone, and the one it runs
// again on a new connection finds the claim taken (dedupe.ErrClaimLost).
// One effect, B's.
func TestLongTxAtRepeatableReadZombieTakenOverAfterItsTxEnds(t *testing.T) {
	t.Parallel()
	for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(iso.String(), func(t *testing.T) {
			t.Parallel()
			e := newTxEnv(t, stdOf(testenv.Postgres(t)))
			pids := make(chan int, 4)
			wake := make(chan struct{})
			var aRuns atomic.Int64
			a := newRRWorker(t, e, iso, func(ctx context.Context, tx *sql.Tx, msg *message.Message) error {
				if aRuns.Add(1) > 1 {
					return nil // a rerun on a new connection: the hold must have refused it
				}
				var pid int
				if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
					return err
				}
				pids <- pid
				<-wake // stopped, past its claim timeout
				return nil
			})
			b := newRRWorker(t, e, iso, func(context.Context, *sql.Tx, *message.Message) error { return nil })
			msg := message.NewMessage(watermill.NewUUID(), nil)
			aDone := make(chan error, 1)
			go func() { aDone <- a.deliver(t.Context(), msg) }()
			pid := <-pids
			time.Sleep(900 * time.Millisecond) // A's committed claim has expired
			// B meets A's lock: deferred, not run.
			if err := b.deliver(t.Context(), msg); err == nil || b.runs.Load() != 0 {
				t.Fatalf("B while A's transaction lives: %v, ran %d times; want deferred, not run", err, b.runs.Load())
			}
			var ok bool
			must(t, e.db.sql.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1)", pid).Scan(&ok))
			if !ok {
				t.Fatalf("could not terminate A's backend %d", pid)
			}
			deadline := time.Now().Add(20 * time.Second)
			for {
				err := b.deliver(t.Context(), msg)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("B never took the key over after A's transaction ended: %v", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
			close(wake)
			aErr := <-aDone
			if !errors.Is(aErr, dedupe.ErrClaimLost) {
				t.Errorf("A after waking: %v, want its claim lost", aErr)
			}
			if n := e.rows(t); n != 1 || b.runs.Load() != 1 {
				t.Fatalf("%d effect rows, B ran %d times; want one effect, B's", n, b.runs.Load())
			}
		})
	}
}

// Behind the dedupe middleware, a batch (and the one-statement mode, which
// then holds and confirms the middleware's claim) at REPEATABLE READ and
// SERIALIZABLE whose transaction outlives several renewals: every claim is
// held by the transaction before its handlers run, so the confirmations
// commit. Before, each confirmation failed with 40001 and the deliveries
// were deferred for ever.
func TestLongTxAtRepeatableReadBehindMiddleware(t *testing.T) {
	t.Parallel()
	modes := []struct {
		name string
		cfg  func(*pipeline.TxConfig[*sql.Tx])
	}{
		{"batch", func(c *pipeline.TxConfig[*sql.Tx]) {
			c.Batch = pipeline.BatchConfig{MaxSize: 4, MaxWait: 50 * time.Millisecond}
		}},
		{"one-statement", func(c *pipeline.TxConfig[*sql.Tx]) { c.OneStatement = true }},
	}
	for _, mode := range modes {
		for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
			t.Run(mode.name+"/"+iso.String(), func(t *testing.T) {
				t.Parallel()
				e := newTxEnv(t, stdOf(testenv.Postgres(t)))
				dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 900 * time.Millisecond,
					RenewInterval: 200 * time.Millisecond, BusyDelay: time.Millisecond})
				must(t, err)
				cfg := pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Store: e.store, TxOptions: &sql.TxOptions{Isolation: iso}, BusyDelay: time.Millisecond}
				mode.cfg(&cfg)
				var runs atomic.Int64
				h, err := pipeline.NewTxHandler(cfg, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
					var n int
					if err := tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+e.charges).Scan(&n); err != nil {
						return err // the snapshot is taken here, if not by the hold
					}
					if runs.Add(1) == 1 {
						time.Sleep(700 * time.Millisecond) // three renewals of every claim in the batch
					}
					_, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 100)", msg.UUID)
					return err
				})
				must(t, err)
				stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
				handle := func(m *message.Message) error { _, err := stack(m); return err }
				msgs := orders(4, "rr")
				redelivered := false
				if cfg.OneStatement {
					// One transaction each, one at a time: concurrent
					// SERIALIZABLE transactions on one claims table may
					// fail as any do (read/write dependencies), which
					// is not what this test is about.
					for _, m := range msgs {
						must(t, handle(m))
					}
				} else {
					// Redelivered as a broker would: four deliveries that
					// a loaded machine splits into two batches at
					// SERIALIZABLE may fail each other with 40001 as any
					// two such transactions may; what this test is about
					// is that the confirmations commit at last, where
					// before they were deferred for ever.
					errs := deliverAll(handle, msgs)
					for round := 0; round < 5 && slices.ContainsFunc(errs, func(err error) bool { return err != nil }); round++ {
						var again []*message.Message
						for i, err := range errs {
							if err != nil {
								again = append(again, msgs[i])
							}
						}
						errs = deliverAll(handle, again)
						msgs, redelivered = again, true
					}
					onlyFailed(t, errs, "rr", -1, nil)
					if redelivered {
						// A run whose transaction was rolled back ran
						// again: one effect each all the same.
						runs.Store(4)
					}
				}
				if n := e.rows(t); n != 4 || runs.Load() != 4 {
					t.Fatalf("%d effect rows after %d runs, want 4 of 4", n, runs.Load())
				}
				if !redelivered {
					confirmedAfter(t, e.store, "rr", 4, -1)
					return
				}
				for i := range 4 { // a rolled-back run was an attempt
					c, err := e.store.Claim(t.Context(), fmt.Sprintf("rr-%d", i), time.Minute)
					must(t, err)
					if c.Result != dedupe.Duplicate {
						t.Errorf("rr-%d's key: %v, want confirmed", i, c.Result)
					}
				}
			})
		}
	}
}
