package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// txEnv is a claims table, an outbox and a charges table on one database
// under one driver. charges has a key on order_id.
type txEnv[TTx any] struct {
	db      db[TTx]
	claims  string // the claims table
	store   *dedupe.SQLStore[TTx]
	ob      *outbox.Outbox[TTx]
	charges string
}

func newTxEnv[TTx any](t *testing.T, d db[TTx]) *txEnv[TTx] {
	t.Helper()
	store, claims := claimsTableNamed(t, d)
	name := testenv.Name(t, "tx")
	topic := "ob_" + name[len(name)-8:]
	ob, err := outbox.New(d.Driver, outbox.Config{Topic: topic})
	must(t, err)
	must(t, ob.InitSchema(t.Context()))
	charges := "charges_" + name[len(name)-8:]
	d.exec(t, "CREATE TABLE "+charges+" (order_id VARCHAR(64) PRIMARY KEY, cents INTEGER NOT NULL)")
	t.Cleanup(func() {
		for _, tbl := range []string{charges, d.quote(topic), d.quote(topic + "_relays")} {
			_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+tbl)
		}
	})
	return &txEnv[TTx]{db: d, claims: claims, store: store, ob: ob, charges: charges}
}

func (e *txEnv[TTx]) rows(t *testing.T) int {
	t.Helper()
	return e.db.count(t, "SELECT COUNT(*) FROM "+e.charges)
}

func (e *txEnv[TTx]) pending(t *testing.T) int64 {
	t.Helper()
	st, err := e.ob.Status(t.Context())
	must(t, err)
	return st.Pending
}

// handler is the stack a user writes: dedupe middleware, then the
// transactional handler.
func (e *txEnv[TTx]) handler(t *testing.T, fn pipeline.TxFunc[TTx]) message.HandlerFunc {
	t.Helper()
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second})
	must(t, err)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob}, fn)
	must(t, err)
	return dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
}

// handlerIn is handler, or with oneStatement the handler alone, claiming
// its keys in its transaction.
func (e *txEnv[TTx]) handlerIn(t *testing.T, oneStatement bool, fn pipeline.TxFunc[TTx]) func(*message.Message) error {
	t.Helper()
	if oneStatement {
		h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob, OneStatement: true, Store: e.store}, fn)
		must(t, err)
		return h
	}
	h := e.handler(t, fn)
	return func(msg *message.Message) error { _, err := h(msg); return err }
}

// charge writes the message's charge in the transaction (through the
// driver's executor, whatever TTx is), publishes a receipt on the outbox
// and returns fail.
func (e *txEnv[TTx]) charge(fail error) pipeline.TxFunc[TTx] {
	return func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
		if _, err := e.db.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+e.db.ph(1)+", "+e.db.ph(2)+")", string(msg.Payload), 1999); err != nil {
			return err
		}
		receipt := message.NewMessage("receipt-"+msg.UUID, msg.Payload)
		receipt.SetContext(ctx)
		if err := out.Publish("receipts", receipt); err != nil {
			return err
		}
		return fail
	}
}

// modes runs fn behind the dedupe middleware and in the one-statement mode.
func modes(t *testing.T, fn func(t *testing.T, oneStatement bool)) {
	for _, one := range []bool{false, true} {
		name := "middleware"
		if one {
			name = "one-statement"
		}
		t.Run(name, func(t *testing.T) { fn(t, one) })
	}
}

func TestTxHandlerCommitsWritesOutboxAndConfirmTogether(t *testing.T) {
	t.Parallel()
	onEachDriver(t, commitsTogether[*sql.Tx], commitsTogether[pgx.Tx])
}

func commitsTogether[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	h := e.handler(t, e.charge(nil))
	for range 3 { // the broker delivers the same message three times
		_, err := h(message.NewMessage("order-msg-1", []byte("A-17")))
		must(t, err)
	}
	if n, p := e.rows(t), e.pending(t); n != 1 || p != 1 {
		t.Fatalf("charges=%d outbox=%d; want exactly one of each", n, p)
	}
	c, err := e.store.Claim(t.Context(), "order-msg-1", time.Minute)
	must(t, err)
	if c.Result != dedupe.Duplicate || c.Attempt != 1 {
		t.Fatalf("claim after = %+v; want a duplicate confirmed on attempt 1", c)
	}

	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer ps.Close()
	receipts, err := ps.Subscribe(t.Context(), "receipts")
	must(t, err)
	n, err := e.ob.Forward(t.Context(), ps, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil || n != 1 {
		t.Fatalf("Forward = %d, %v; want 1", n, err)
	}
	if m := <-receipts; m.UUID != "receipt-order-msg-1" {
		t.Fatalf("receipt %s", m.UUID)
	}
}

// A failing handler's transaction is rolled back whole, in both modes: no
// charge, no outbox row, no confirmation; behind the middleware the failed
// attempt still counts. The redelivery does the work once.
func TestTxHandlerRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	onEachDriver(t, rollbackLeavesNothing[*sql.Tx], rollbackLeavesNothing[pgx.Tx])
}

func rollbackLeavesNothing[TTx any](t *testing.T, d db[TTx]) {
	modes(t, func(t *testing.T, one bool) {
		e := newTxEnv(t, d)
		declined := errors.New("card declined")
		var fail atomic.Bool
		fail.Store(true)
		h := e.handlerIn(t, one, func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			if fail.Load() {
				return declined
			}
			return nil
		})
		if err := h(message.NewMessage("order-msg-2", []byte("A-18"))); !errors.Is(err, declined) {
			t.Fatalf("err = %v, want the handler's error", err)
		}
		if n, p := e.rows(t), e.pending(t); n != 0 || p != 0 {
			t.Fatalf("after rollback charges=%d outbox=%d; want none", n, p)
		}
		c, err := e.store.Claim(t.Context(), "order-msg-2", time.Minute)
		must(t, err)
		want := 1 // one statement: a rolled-back attempt leaves no count
		if !one {
			want = 2 // the claim was released, and the failed attempt still counts
		}
		if c.Result != dedupe.Acquired || c.Attempt != want {
			t.Fatalf("claim after rollback = %+v; want acquired as attempt %d", c, want)
		}
		must(t, e.store.Release(t.Context(), c))
		fail.Store(false)
		for range 3 {
			must(t, h(message.NewMessage("order-msg-2", []byte("A-18"))))
		}
		if n, p := e.rows(t), e.pending(t); n != 1 || p != 1 {
			t.Fatalf("charges=%d outbox=%d for three deliveries; want one of each", n, p)
		}
		if c, err := e.store.Claim(t.Context(), "order-msg-2", time.Minute); err != nil || c.Result != dedupe.Duplicate {
			t.Fatalf("claim after commit = %+v, %v; want duplicate", c, err)
		}
	})
}

// The commit's error is the handler's result, in both modes: a deferred
// constraint makes the commit itself fail on PostgreSQL, and the
// confirmation made in the transaction goes with it.
func TestTxHandlerReturnsCommitError(t *testing.T) {
	t.Parallel()
	onPostgres(t, returnsCommitError[*sql.Tx], returnsCommitError[pgx.Tx])
}

func returnsCommitError[TTx any](t *testing.T, d db[TTx]) {
	modes(t, func(t *testing.T, one bool) {
		e := newTxEnv(t, d)
		uniq := "uniq_" + e.charges
		d.exec(t, "CREATE TABLE "+uniq+" (k INT, CONSTRAINT "+uniq+"_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
		t.Cleanup(func() { _, _ = d.sql.ExecContext(context.Background(), "DROP TABLE "+uniq) })
		var calls atomic.Int64
		h := e.handlerIn(t, one, func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			calls.Add(1)
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+uniq+" VALUES (1), (1)") // fails only at commit
			return err
		})
		err := h(message.NewMessage("order-msg-3", []byte("A-19")))
		if err == nil || !strings.Contains(err.Error(), "commit") || calls.Load() != 1 {
			t.Fatalf("err = %v after %d calls; want the commit's error", err, calls.Load())
		}
		if n, p := e.rows(t), e.pending(t); n != 0 || p != 0 {
			t.Fatalf("after a failed commit charges=%d outbox=%d; want none", n, p)
		}
		c, err := e.store.Claim(t.Context(), "order-msg-3", time.Minute)
		must(t, err)
		if c.Result != dedupe.Acquired {
			t.Fatalf("claim after failed commit = %+v; want it released: the confirmation must not outlive the commit", c)
		}
	})
}

func TestTxHandlerNeedsTheDedupeMiddleware(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, stdOf(testenv.SQLite(t)))
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Outbox: e.ob}, e.charge(nil))
	must(t, err)
	err = h(message.NewMessage("m", []byte("A-20")))
	if !errors.Is(err, dedupe.ErrNoClaim) {
		t.Fatalf("err = %v, want ErrNoClaim", err)
	}
	if n := e.rows(t); n != 0 {
		t.Fatalf("%d charges written without a claim", n)
	}
}

// One statement per message: the claim is written as confirmed inside the
// transaction, without the dedupe middleware.
func TestTxHandlerOneStatement(t *testing.T) {
	t.Parallel()
	onEachDriver(t, oneStatement[*sql.Tx], oneStatement[pgx.Tx])
}

func oneStatement[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	declined := errors.New("card declined")
	var fail atomic.Bool
	fail.Store(true)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob, OneStatement: true, Store: e.store},
		func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			if fail.Load() {
				return declined
			}
			return nil
		})
	must(t, err)
	if err := h(message.NewMessage("one-1", []byte("A-30"))); !errors.Is(err, declined) {
		t.Fatalf("err = %v, want the handler's error", err)
	}
	if n, p := e.rows(t), e.pending(t); n != 0 || p != 0 {
		t.Fatalf("after rollback charges=%d outbox=%d", n, p)
	}
	fail.Store(false)
	for range 3 {
		err := h(message.NewMessage("one-1", []byte("A-30")))
		must(t, err)
	}
	if n, p := e.rows(t), e.pending(t); n != 1 || p != 1 {
		t.Fatalf("charges=%d outbox=%d; want exactly one of each for three deliveries", n, p)
	}
	c, err := e.store.Claim(t.Context(), "one-1", time.Minute)
	must(t, err)
	if c.Result != dedupe.Duplicate {
		t.Fatalf("claim after = %+v; want duplicate", c)
	}
}

// The caller's own transaction: a claim and a write made in it and rolled
// back leave neither; committed, both land.
func TestStoreInCallersTx(t *testing.T) {
	t.Parallel()
	onEachDriver(t, storeInCallersTx[*sql.Tx], storeInCallersTx[pgx.Tx])
}

func storeInCallersTx[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	ctx := t.Context()
	for _, commit := range []bool{false, true} {
		tx, err := d.Begin(ctx, nil, "")
		must(t, err)
		c, err := e.store.WithTx(tx).ClaimConfirmed(ctx, "own-1")
		must(t, err)
		if c.Result != dedupe.Acquired {
			t.Fatalf("claim in tx = %v", c.Result)
		}
		_, err = d.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ('own-1', 1)")
		must(t, err)
		if commit {
			must(t, d.Commit(ctx, tx))
			continue
		}
		must(t, d.Rollback(ctx, tx))
		if n := e.rows(t); n != 0 {
			t.Fatalf("rolled back: %d charges", n)
		}
		got, err := e.store.Claim(ctx, "own-1", time.Minute)
		must(t, err)
		if got.Result != dedupe.Acquired || got.Attempt != 1 {
			t.Fatalf("rolled back: claim = %+v, want a first acquisition", got)
		}
		must(t, e.store.Release(ctx, got))
	}
	if n := e.rows(t); n != 1 {
		t.Fatalf("committed: %d charges", n)
	}
	if c, err := e.store.Claim(ctx, "own-1", time.Minute); err != nil || c.Result != dedupe.Duplicate {
		t.Fatalf("committed: claim = %+v, %v; want duplicate", c, err)
	}
}

// Workers on separate connections deliver the same messages many times at
// once, in random order with random delays inside the transaction: each
// message's effect commits exactly once, in both modes.
func TestTxHandlerConcurrentDeliveriesEffectOnce(t *testing.T) {
	t.Parallel()
	onServers(t, concurrentEffectOnce[*sql.Tx], concurrentEffectOnce[pgx.Tx])
}

func concurrentEffectOnce[TTx any](t *testing.T, d db[TTx]) {
	modes(t, func(t *testing.T, one bool) {
		e := newTxEnv(t, d)
		// No key on order_id: an effect done twice shows as two rows.
		multi := e.charges + "_m"
		d.exec(t, "CREATE TABLE "+multi+" (order_id VARCHAR(64) NOT NULL)")
		t.Cleanup(func() { _, _ = d.sql.ExecContext(context.Background(), "DROP TABLE "+multi) })
		h := e.handlerIn(t, one, func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			if _, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+multi+" (order_id) VALUES ("+d.ph(1)+")", string(msg.Payload)); err != nil {
				return err
			}
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
			return nil
		})
		const keys, copies, workers = 40, 3, 6
		var work []int
		for k := range keys {
			for range copies {
				work = append(work, k)
			}
		}
		rand.Shuffle(len(work), func(i, j int) { work[i], work[j] = work[j], work[i] })
		next := make(chan int, len(work))
		for _, k := range work {
			next <- k
		}
		close(next)
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for range workers {
			wg.Go(func() {
				for k := range next {
					// Busy is a redelivery later: retry until settled.
					for {
						err := h(message.NewMessage(fmt.Sprintf("c-%d", k), []byte(fmt.Sprintf("C-%d", k))))
						if err == nil {
							break
						}
						if !errors.Is(err, dedupe.ErrBusy) && !errors.Is(err, dedupe.ErrUnavailable) {
							errs <- err
							return
						}
						time.Sleep(time.Millisecond)
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		total := d.count(t, "SELECT COUNT(*) FROM "+multi)
		distinct := d.count(t, "SELECT COUNT(DISTINCT order_id) FROM "+multi)
		if total != keys || distinct != keys {
			t.Fatalf("%d charges for %d orders delivered %d times each; want exactly %d", total, distinct, copies, keys)
		}
	})
}

func TestTxConfigIsChecked(t *testing.T) {
	t.Parallel()
	db := sqldb.Std(&sql.DB{}, sqldb.Postgres)
	fn := func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil }
	for _, c := range []struct {
		cfg  pipeline.TxConfig[*sql.Tx]
		want string
	}{
		{pipeline.TxConfig[*sql.Tx]{}, "TxConfig.DB"},
		{pipeline.TxConfig[*sql.Tx]{DB: db, OneStatement: true}, "TxConfig.Store"},
		{pipeline.TxConfig[*sql.Tx]{DB: db, Batch: pipeline.BatchConfig{MaxSize: 4}}, "TxConfig.Store"},
		{pipeline.TxConfig[*sql.Tx]{DB: db, Batch: pipeline.BatchConfig{MaxSize: -1}}, "TxConfig.Batch.MaxSize"},
		{pipeline.TxConfig[*sql.Tx]{DB: db, BusyDelay: -2}, "TxConfig.BusyDelay"},
		{pipeline.TxConfig[*sql.Tx]{DB: db, CallTimeout: time.Millisecond}, "TxConfig.CallTimeout"},
	} {
		if _, err := pipeline.NewTxHandler(c.cfg, fn); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err = %v, want one naming %s", c.cfg, err, c.want)
		}
	}
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: db}, nil); err == nil {
		t.Error("NewTxHandler with a nil function succeeded")
	}
}

// HandleTx on a router: each delivery of a message settles once, a failing
// attempt is retried, in both modes, on every driver.
func TestPipelineHandleTx(t *testing.T) {
	t.Parallel()
	onEachDriver(t, pipelineHandleTx[*sql.Tx], pipelineHandleTx[pgx.Tx])
}

func pipelineHandleTx[TTx any](t *testing.T, d db[TTx]) {
	modes(t, func(t *testing.T, one bool) {
		e := newTxEnv(t, d)
		h := newHarness(t, e.store)
		var failed atomic.Bool
		_, err := pipeline.HandleTx(h.p, "charge", "payments", h.pubsub, pipeline.TxConfig[TTx]{DB: d.Driver, OneStatement: one},
			func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
				if _, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+d.ph(1)+", 1)", string(msg.Payload)); err != nil {
					return err
				}
				if msg.UUID == "p-2" && failed.CompareAndSwap(false, true) {
					return errors.New("first attempt fails after its write")
				}
				return nil
			})
		must(t, err)
		h.run(t)
		for _, id := range []string{"p-1", "p-1", "p-2"} {
			must(t, h.pubsub.Publish("payments", message.NewMessage(id, []byte(strings.ToUpper(id)))))
		}
		waitFor(t, "three acked deliveries", func() bool {
			n := 0
			for _, s := range h.spans.Ended() {
				if settledAs(s) == "ack" {
					n++
				}
			}
			return n == 3
		})
		if n := e.rows(t); n != 2 || !failed.Load() {
			t.Fatalf("%d charges (failed once: %v); want one for each of two orders", n, failed.Load())
		}
	})
}

// HandleTx needs a SQLStore of its driver, and says which.
func TestHandleTxNeedsASQLStoreOfItsDriver(t *testing.T) {
	t.Parallel()
	fn := func(context.Context, pgx.Tx, *message.Message, message.Publisher) error { return nil }
	h := newHarness(t, dedupe.NewMemoryStore())
	_, err := pipeline.HandleTx(h.p, "x", "t", h.pubsub, pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(nil)}, fn)
	if err == nil || !strings.Contains(err.Error(), "*dedupe.SQLStore[pgx.Tx]") || !strings.Contains(err.Error(), "MemoryStore") {
		t.Fatalf("HandleTx with a memory store: %v", err)
	}
	lite := stdOf(testenv.SQLite(t))
	h = newHarness(t, claimsTable(t, lite))
	_, err = pipeline.HandleTx(h.p, "x", "t", h.pubsub, pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(nil)}, fn)
	if err == nil || !strings.Contains(err.Error(), "*dedupe.SQLStore[pgx.Tx]") {
		t.Fatalf("HandleTx on pgx with a database/sql store: %v", err)
	}
}

func TestTypedTx(t *testing.T) {
	t.Parallel()
	var got order
	fn := pipeline.TypedTx(nil, func(ctx context.Context, tx pgx.Tx, m pipeline.Message[order], out message.Publisher) error {
		got = m.Body
		return nil
	})
	must(t, fn(t.Context(), nil, message.NewMessage("t-1", []byte(`{"id":"A-7","cents":12}`)), nil))
	if got != (order{ID: "A-7", Cents: 12}) {
		t.Fatalf("decoded %+v", got)
	}
	got = order{}
	if err := fn(t.Context(), nil, message.NewMessage("t-2", []byte(`not json`)), nil); err == nil || got != (order{}) {
		t.Fatalf("bad payload: err = %v, fn saw %+v", err, got)
	}
}
