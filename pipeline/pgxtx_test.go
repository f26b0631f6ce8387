package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// pgxEnv is a claims table and a charges table on PostgreSQL, used through
// a pgx pool. charges has no key on order_id, so an effect done twice shows
// as two rows.
type pgxEnv struct {
	pool    *pgxpool.Pool
	store   *dedupe.SQLStore[pgx.Tx]
	charges string
}

func newPgxEnv(t *testing.T) *pgxEnv {
	t.Helper()
	db, pool := testenv.Postgres(t), testenv.PgxPool(t)
	store, err := dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	must(t, err)
	charges := testenv.Name(t, "charges")
	_, err = pool.Exec(t.Context(), `CREATE TABLE "`+charges+`" (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)`)
	must(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+charges+`"`) })
	return &pgxEnv{pool: pool, store: store, charges: charges}
}

// charge writes one charge row for the message, then returns fail.
func (e *pgxEnv) charge(fail error) pipeline.PgxTxFunc {
	return func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
		if out != nil {
			return errors.New("a pgx handler without an outbox got a publisher")
		}
		if _, err := tx.Exec(ctx, `INSERT INTO "`+e.charges+`" (order_id) VALUES ($1)`, string(msg.Payload)); err != nil {
			return err
		}
		return fail
	}
}

func (e *pgxEnv) rows(t *testing.T, orderID string) int {
	t.Helper()
	var n int
	must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*) FROM "`+e.charges+`" WHERE order_id = $1`, orderID).Scan(&n))
	return n
}

// handler is a pgx transactional handler as a user stacks it: behind the
// dedupe middleware (claim outside, ConfirmPgxTx inside), or alone with
// OneStatement.
func (e *pgxEnv) handler(t *testing.T, oneStatement bool, fn pipeline.PgxTxFunc) func(*message.Message) error {
	t.Helper()
	if oneStatement {
		h, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, OneStatement: true, Store: e.store}, fn)
		must(t, err)
		return h
	}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second})
	must(t, err)
	h, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool}, fn)
	must(t, err)
	wrapped := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	return func(msg *message.Message) error { _, err := wrapped(msg); return err }
}

func pgxModes(t *testing.T, fn func(t *testing.T, oneStatement bool)) {
	for _, one := range []bool{false, true} {
		name := "middleware"
		if one {
			name = "one-statement"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, one)
		})
	}
}

// A failing handler's pgx transaction is rolled back whole: no charge and no
// confirmation; the redelivery does the work once, later ones are
// duplicates.
func TestPgxTxHandlerRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	pgxModes(t, func(t *testing.T, one bool) {
		e := newPgxEnv(t)
		declined := errors.New("card declined")
		var fail atomic.Bool
		fail.Store(true)
		h := e.handler(t, one, func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			if fail.Load() {
				return declined
			}
			return nil
		})
		if err := h(message.NewMessage("m-1", []byte("A-1"))); !errors.Is(err, declined) {
			t.Fatalf("err = %v, want the handler's error", err)
		}
		if n := e.rows(t, "A-1"); n != 0 {
			t.Fatalf("after rollback %d charges", n)
		}
		// The key was not confirmed: a claim gets it (and gives it back).
		c, err := e.store.Claim(t.Context(), "m-1", time.Minute)
		must(t, err)
		if c.Result != dedupe.Acquired {
			t.Fatalf("claim after rollback = %v, want acquired", c.Result)
		}
		must(t, e.store.Release(t.Context(), c))
		fail.Store(false)
		for range 3 {
			must(t, h(message.NewMessage("m-1", []byte("A-1"))))
		}
		if n := e.rows(t, "A-1"); n != 1 {
			t.Fatalf("%d charges for three deliveries, want 1", n)
		}
		if c, err := e.store.Claim(t.Context(), "m-1", time.Minute); err != nil || c.Result != dedupe.Duplicate {
			t.Fatalf("claim after commit = %+v, %v; want duplicate", c, err)
		}
	})
}

// The caller's own pgx.Tx: a claim and a write made in it and rolled back
// leave neither; committed, both land.
func TestPgxStoreInCallersTx(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	ctx := t.Context()
	for _, commit := range []bool{false, true} {
		tx, err := e.pool.Begin(ctx)
		must(t, err)
		c, err := e.store.WithTx(tx).ClaimConfirmed(ctx, "own-1")
		must(t, err)
		if c.Result != dedupe.Acquired {
			t.Fatalf("claim in tx = %v", c.Result)
		}
		_, err = tx.Exec(ctx, `INSERT INTO "`+e.charges+`" (order_id) VALUES ('own-1')`)
		must(t, err)
		if commit {
			must(t, tx.Commit(ctx))
		} else {
			must(t, tx.Rollback(ctx))
			if n := e.rows(t, "own-1"); n != 0 {
				t.Fatalf("rolled back: %d charges", n)
			}
			got, err := e.store.Claim(ctx, "own-1", time.Minute)
			must(t, err)
			if got.Result != dedupe.Acquired || got.Attempt != 1 {
				t.Fatalf("rolled back: claim = %+v, want a first acquisition", got)
			}
			must(t, e.store.Release(ctx, got))
		}
	}
	if n := e.rows(t, "own-1"); n != 1 {
		t.Fatalf("committed: %d charges", n)
	}
	if c, err := e.store.Claim(ctx, "own-1", time.Minute); err != nil || c.Result != dedupe.Duplicate {
		t.Fatalf("committed: claim = %+v, %v; want duplicate", c, err)
	}
}

// Workers on separate pool connections deliver the same messages many times
// at once, in random order with random delays inside the transaction: each
// message's effect commits exactly once.
func TestPgxTxHandlerConcurrentDeliveriesEffectOnce(t *testing.T) {
	t.Parallel()
	pgxModes(t, func(t *testing.T, one bool) {
		e := newPgxEnv(t)
		h := e.handler(t, one, func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
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
					msg := func() *message.Message {
						return message.NewMessage(fmt.Sprintf("c-%d", k), []byte(fmt.Sprintf("C-%d", k)))
					}
					// Busy is a redelivery later: retry until settled.
					for {
						err := h(msg())
						if err == nil {
							break
						}
						if !errors.Is(err, dedupe.ErrBusy) {
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
		var total, distinct int
		must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*), COUNT(DISTINCT order_id) FROM "`+e.charges+`"`).Scan(&total, &distinct))
		if total != keys || distinct != keys {
			t.Fatalf("%d charges for %d orders delivered %d times each; want exactly %d", total, distinct, copies, keys)
		}
	})
}

// Group commit on pgx: deliveries in flight together share a transaction, a
// failing one is taken out and retried alone, the rest commit.
func TestPgxBatchIsolatesAFailingMessage(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	var mu sync.Mutex
	txs := map[pgx.Tx]int{}
	h, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			mu.Lock()
			txs[tx]++
			mu.Unlock()
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			if msg.UUID == "b-3" {
				return errors.New("declined")
			}
			return nil
		})
	must(t, err)
	deliver := func(msgs []*message.Message) []error {
		errs := make([]error, len(msgs))
		var wg sync.WaitGroup
		for i, m := range msgs {
			wg.Go(func() { errs[i] = h(m) })
		}
		wg.Wait()
		return errs
	}
	msgs := orders(8, "b")
	errs := deliver(msgs)
	for i, err := range errs {
		if (i == 3) != (err != nil) {
			t.Fatalf("message %d: err = %v", i, err)
		}
	}
	for i := range 8 {
		want := 1
		if i == 3 {
			want = 0
		}
		if n := e.rows(t, fmt.Sprintf("b-%d", i)); n != want {
			t.Fatalf("b-%d: %d charges, want %d", i, n, want)
		}
	}
	mu.Lock()
	n := len(txs)
	mu.Unlock()
	if n > 4 {
		t.Errorf("8 deliveries in flight together took %d transactions; batching did not happen", n)
	}
	// Redelivered together: the seven done are duplicates, b-3 still fails.
	errs = deliver(orders(8, "b"))
	for i, err := range errs {
		if (i == 3) != (err != nil) {
			t.Fatalf("redelivery %d: err = %v", i, err)
		}
	}
	for i := range 8 {
		if i != 3 && e.rows(t, fmt.Sprintf("b-%d", i)) != 1 {
			t.Fatalf("b-%d done twice", i)
		}
	}
}

func TestPgxTxConfigIsChecked(t *testing.T) {
	t.Parallel()
	fn := func(context.Context, pgx.Tx, *message.Message, message.Publisher) error { return nil }
	for _, c := range []struct {
		cfg  pipeline.PgxTxConfig
		want string
	}{
		{pipeline.PgxTxConfig{}, "PgxTxConfig.DB"},
		{pipeline.PgxTxConfig{DB: &pgxpool.Pool{}, OneStatement: true}, "PgxTxConfig.Store"},
		{pipeline.PgxTxConfig{DB: &pgxpool.Pool{}, Batch: pipeline.BatchConfig{MaxSize: 4}}, "PgxTxConfig.Store"},
		{pipeline.PgxTxConfig{DB: &pgxpool.Pool{}, Batch: pipeline.BatchConfig{MaxSize: -1}}, "PgxTxConfig.Batch.MaxSize"},
	} {
		if _, err := pipeline.NewPgxTxHandler(c.cfg, fn); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err = %v, want one naming %s", c.cfg, err, c.want)
		}
	}
}

// A commit that fails (a deferred constraint checked at commit) is the
// handler's error; the confirmation made in the transaction goes with it.
func TestPgxTxHandlerReturnsCommitError(t *testing.T) {
	t.Parallel()
	pgxModes(t, func(t *testing.T, one bool) {
		e := newPgxEnv(t)
		ctx := t.Context()
		parent, child := e.charges+"_p", e.charges+"_c"
		_, err := e.pool.Exec(ctx, `CREATE TABLE "`+parent+`" (id INT PRIMARY KEY);
CREATE TABLE "`+child+`" (pid INT REFERENCES "`+parent+`" DEFERRABLE INITIALLY DEFERRED)`)
		must(t, err)
		t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+child+`", "`+parent+`"`) })
		h := e.handler(t, one, func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO "`+child+`" (pid) VALUES (1)`) // no parent: fails at commit
			return err
		})
		err = h(message.NewMessage("cm-1", []byte("CM-1")))
		if err == nil || !strings.Contains(err.Error(), "commit") {
			t.Fatalf("err = %v, want the commit's error", err)
		}
		if n := e.rows(t, "CM-1"); n != 0 {
			t.Fatalf("%d charges after a failed commit", n)
		}
		c, err := e.store.Claim(ctx, "cm-1", time.Minute)
		must(t, err)
		if c.Result != dedupe.Acquired {
			t.Fatalf("claim after a failed commit = %v, want acquired: the confirmation must not outlive the commit", c.Result)
		}
	})
}

// HandlePgxTx on a router: each delivery of a message settles once, a
// failing attempt is retried, in both modes.
func TestPipelineHandlePgxTx(t *testing.T) {
	t.Parallel()
	pgxModes(t, func(t *testing.T, one bool) {
		e := newPgxEnv(t)
		h := newHarness(t, e.store)
		var failed atomic.Bool
		_, err := h.p.HandlePgxTx("charge", "payments", h.pubsub, nil, pipeline.PgxTxConfig{DB: e.pool, OneStatement: one},
			func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
				if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
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
				if strings.HasPrefix(s.Name(), "ack ") {
					n++
				}
			}
			return n == 3
		})
		if a, b := e.rows(t, "P-1"), e.rows(t, "P-2"); a != 1 || b != 1 || !failed.Load() {
			t.Fatalf("charges P-1=%d P-2=%d (failed once: %v); want one each", a, b, failed.Load())
		}
	})
	// The pipeline refuses a store that is not a PgxStore.
	h := newHarness(t, dedupe.NewMemoryStore())
	fn := func(context.Context, pgx.Tx, *message.Message, message.Publisher) error { return nil }
	if _, err := h.p.HandlePgxTx("x", "t", h.pubsub, nil, pipeline.PgxTxConfig{DB: &pgxpool.Pool{}}, fn); err == nil || !strings.Contains(err.Error(), "SQLStore[pgx.Tx]") {
		t.Fatalf("HandlePgxTx with a memory store: %v", err)
	}
}

// ConfirmTx of a pgx.Tx works with the pgx store in the middleware, and
// refuses a store of another driver, naming both types.
func TestConfirmTxOfPgxStores(t *testing.T) {
	t.Parallel()
	db, pool := testenv.Postgres(t), testenv.PgxPool(t)
	table := testenv.DedupeTable(t, db)
	pgxStore, err := dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: table})
	must(t, err)
	lite := testenv.SQLite(t)
	liteStore, err := dedupe.NewSQLStore(lite.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, lite)})
	must(t, err)
	run := func(store dedupe.Store, id string) error {
		dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
		must(t, err)
		h := dd(func(msg *message.Message) ([]*message.Message, error) {
			tx, err := pool.Begin(msg.Context())
			if err != nil {
				return nil, err
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if err := dedupe.ConfirmTx(msg.Context(), tx); err != nil {
				return nil, err
			}
			return nil, tx.Commit(msg.Context())
		})
		_, err = h(message.NewMessage(id, nil))
		return err
	}
	must(t, run(pgxStore, "s-1"))
	if c, err := pgxStore.Claim(t.Context(), "s-1", time.Minute); err != nil || c.Result != dedupe.Duplicate {
		t.Fatalf("after ConfirmTx with the pgx store: %+v, %v; want duplicate", c, err)
	}
	if err := run(liteStore, "l-1"); err == nil || !strings.Contains(err.Error(), "*dedupe.SQLStore[*sql.Tx]") {
		t.Fatalf("ConfirmTx of a pgx.Tx with a database/sql store: %v", err)
	}
	if c, err := liteStore.Claim(t.Context(), "l-1", time.Minute); err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("the refused confirmation released the SQLite claim: %+v, %v; want acquired", c, err)
	}
}

func TestTypedPgxTx(t *testing.T) {
	t.Parallel()
	var got order
	fn := pipeline.TypedPgxTx(nil, func(ctx context.Context, tx pgx.Tx, m pipeline.Message[order], out message.Publisher) error {
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

// A pgx transactional handler with an outbox: its message commits with its
// write, through the caller's pgx.Tx; a failed attempt leaves neither.
func TestPgxTxHandlerPublishesThroughTheOutbox(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	name := testenv.Name(t, "ob")
	ob, err := outbox.New(outbox.Config{Dialect: sqldb.Postgres, Topic: "ob_" + name[len(name)-8:]})
	must(t, err)
	must(t, ob.PgxInitSchema(t.Context(), e.pool))
	t.Cleanup(func() {
		_, _ = e.pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+ob.Table()+`", "`+ob.Table()+`_relays"`)
	})
	declined := errors.New("card declined")
	var fail atomic.Bool
	fail.Store(true)
	h, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, Outbox: ob, OneStatement: true, Store: e.store},
		func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			if _, err := tx.Exec(ctx, `INSERT INTO "`+e.charges+`" (order_id) VALUES ($1)`, string(msg.Payload)); err != nil {
				return err
			}
			if err := out.Publish("receipts", message.NewMessage("receipt-"+msg.UUID, msg.Payload)); err != nil {
				return err
			}
			if fail.Load() {
				return declined
			}
			return nil
		})
	must(t, err)
	pending := func() int64 {
		st, err := ob.PgxStatus(t.Context(), e.pool)
		must(t, err)
		return st.Pending
	}
	if err := h(message.NewMessage("po-1", []byte("P-1"))); !errors.Is(err, declined) {
		t.Fatalf("err = %v, want the handler's", err)
	}
	if n, p := e.rows(t, "P-1"), pending(); n != 0 || p != 0 {
		t.Fatalf("after the failed attempt: %d charges, %d outbox rows; want none", n, p)
	}
	fail.Store(false)
	for range 2 {
		must(t, h(message.NewMessage("po-1", []byte("P-1"))))
	}
	if n, p := e.rows(t, "P-1"), pending(); n != 1 || p != 1 {
		t.Fatalf("after two deliveries: %d charges, %d outbox rows; want one of each", n, p)
	}
}
