package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// batchEnv is a batched transactional handler on one database that records
// which transaction each call ran in.
type batchEnv[TTx any] struct {
	*txEnv[TTx]
	h message.NoPublishHandlerFunc

	mu    sync.Mutex
	txs   map[any]int    // calls per transaction
	calls map[string]int // calls per message
}

func newBatchEnv[TTx any](t *testing.T, e *txEnv[TTx], fn func(msg *message.Message, call int) error) *batchEnv[TTx] {
	t.Helper()
	b := &batchEnv[TTx]{txEnv: e, txs: map[any]int{}, calls: map[string]int{}}
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 16, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			b.mu.Lock()
			b.txs[any(tx)]++
			b.calls[msg.UUID]++
			call := b.calls[msg.UUID]
			b.mu.Unlock()
			if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
				return err
			}
			return fn(msg, call)
		})
	must(t, err)
	b.h = h
	return b
}

// deliver hands the messages to the handler all at once, as competing
// subscriptions would, and returns each one's result.
func (b *batchEnv[TTx]) deliver(msgs ...*message.Message) []error { return deliverAll(b.h, msgs) }

// deliverAll calls h for every message at once, each from its own
// goroutine, and returns each one's result.
func deliverAll(h message.NoPublishHandlerFunc, msgs []*message.Message) []error {
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, m := range msgs {
		wg.Go(func() {
			<-start
			errs[i] = h(m)
		})
	}
	close(start)
	wg.Wait()
	return errs
}

func (b *batchEnv[TTx]) transactions() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.txs)
}

func orders(n int, prefix string) []*message.Message {
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("%s-%d", prefix, i), []byte(fmt.Sprintf("%s-%d", prefix, i))))
	}
	return msgs
}

// One failing message in a batch: the others commit together, only it is
// retried, and its redelivery does the work.
func TestBatchIsolatesAFailingMessage(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchIsolatesAFailingMessage[*sql.Tx], batchIsolatesAFailingMessage[pgx.Tx])
}

func batchIsolatesAFailingMessage[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	declined := errors.New("card declined")
	b := newBatchEnv(t, e, func(msg *message.Message, call int) error {
		if msg.UUID == "batch-7" && call == 1 {
			return declined
		}
		return nil
	})
	errs := b.deliver(orders(16, "batch")...)
	for i, err := range errs {
		if i == 7 {
			if !errors.Is(err, declined) {
				t.Fatalf("batch-7: %v, want the handler's error", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("batch-%d: %v", i, err)
		}
	}
	if n, p := e.rows(t), e.pending(t); n != 15 || p != 15 {
		t.Fatalf("charges=%d outbox=%d after the batch; want 15 of each (all but the failing one)", n, p)
	}
	// 16 deliveries, but far fewer commits: the batch, run again without
	// the failing message after it failed.
	if n := b.transactions(); n > 4 {
		t.Fatalf("%d transactions for 16 deliveries, want a few", n)
	}
	must(t, b.deliver(message.NewMessage("batch-7", []byte("batch-7")))[0])
	if n := e.rows(t); n != 16 {
		t.Fatalf("charges=%d after the retry, want 16", n)
	}
	c, err := e.store.Claim(t.Context(), "batch-3", time.Minute)
	must(t, err)
	if c.Result != dedupe.Duplicate {
		t.Fatalf("a committed key is %v, want duplicate", c.Result)
	}
}

// The same message twice in one batch, and again in a later batch: the work
// is done once.
func TestBatchRunsDuplicatesOnce(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchRunsDuplicatesOnce[*sql.Tx], batchRunsDuplicatesOnce[pgx.Tx])
}

func batchRunsDuplicatesOnce[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	b := newBatchEnv(t, e, func(*message.Message, int) error { return nil })
	msgs := orders(8, "dup")
	twice := append(append([]*message.Message{}, msgs...), orders(8, "dup")...)
	settled := map[string]bool{}
	for round := 0; len(settled) < 8 && round < 10; round++ {
		var left []*message.Message
		for _, m := range twice {
			if !settled[m.UUID] {
				left = append(left, m)
			}
		}
		for i, err := range b.deliver(left...) {
			switch {
			case err == nil:
				settled[left[i].UUID] = true
			case !errors.Is(err, dedupe.ErrBusy):
				t.Fatalf("%s: %v", left[i].UUID, err)
			}
		}
	}
	for _, err := range b.deliver(twice...) { // every one a duplicate now
		must(t, err)
	}
	if n := e.rows(t); n != 8 {
		t.Fatalf("charges=%d for 8 messages delivered 4 times each, want 8", n)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for uuid, n := range b.calls {
		if n != 1 {
			t.Errorf("%s: handler ran %d times, want 1", uuid, n)
		}
	}
}

// A panic in one handler call of a batch fails that message only.
func TestBatchContainsAPanic(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchContainsAPanic[*sql.Tx], batchContainsAPanic[pgx.Tx])
}

func batchContainsAPanic[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	var panics atomic.Int64
	b := newBatchEnv(t, e, func(msg *message.Message, call int) error {
		if msg.UUID == "p-3" {
			panics.Add(1)
			panic("bug")
		}
		return nil
	})
	errs := b.deliver(orders(8, "p")...)
	var hp *middleware.PanicError
	if !errors.As(errs[3], &hp) {
		t.Fatalf("p-3: %v, want a middleware.PanicError", errs[3])
	}
	for i, err := range errs {
		if i != 3 && err != nil {
			t.Fatalf("p-%d: %v", i, err)
		}
	}
	if n := e.rows(t); n != 7 {
		t.Fatalf("charges=%d, want 7", n)
	}
}

func TestBatchConfigIsChecked(t *testing.T) {
	t.Parallel()
	db := sqldb.Std(&sql.DB{}, sqldb.Postgres)
	fn := func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil }
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: db, Batch: pipeline.BatchConfig{MaxSize: 8}}, fn); err == nil {
		t.Fatal("Batch without Store accepted")
	}
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: db, Batch: pipeline.BatchConfig{MaxSize: -1}}, fn); err == nil {
		t.Fatal("negative Batch.MaxSize accepted")
	}
	bfn := func(context.Context, *sql.Tx, []*message.Message, message.Publisher) error { return nil }
	if _, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[*sql.Tx]{DB: db}, bfn); err == nil || !strings.Contains(err.Error(), "TxConfig.Batch.MaxSize") {
		t.Fatalf("NewBatchTxHandler without batching: %v", err)
	}
}

// batchHandlerEnv is a batch handler that writes its batch with one
// multi-row insert and records the slices it was given.
type batchHandlerEnv[TTx any] struct {
	*txEnv[TTx]
	h message.NoPublishHandlerFunc

	mu     sync.Mutex
	slices [][]string
}

func newBatchHandlerEnv[TTx any](t *testing.T, e *txEnv[TTx], fn pipeline.BatchTxFunc[TTx]) *batchHandlerEnv[TTx] {
	t.Helper()
	b := &batchHandlerEnv[TTx]{txEnv: e}
	h, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 16, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msgs []*message.Message, out message.Publisher) error {
			var ids []string
			for _, m := range msgs {
				ids = append(ids, m.UUID)
			}
			b.mu.Lock()
			b.slices = append(b.slices, ids)
			b.mu.Unlock()
			return fn(ctx, tx, msgs, out)
		})
	must(t, err)
	b.h = h
	return b
}

// insertAll writes one charge per message in one statement.
func (e *txEnv[TTx]) insertAll(ctx context.Context, tx TTx, msgs []*message.Message) error {
	q := "INSERT INTO " + e.charges + " (order_id, cents) VALUES "
	var args []any
	for i, m := range msgs {
		if i > 0 {
			q += ", "
		}
		q += "(" + e.db.ph(2*i+1) + ", " + e.db.ph(2*i+2) + ")"
		args = append(args, m.UUID, 1)
	}
	_, err := e.db.Tx(tx).Exec(ctx, q, args...)
	return err
}

func (b *batchHandlerEnv[TTx]) deliver(msgs ...*message.Message) []error {
	return deliverAll(b.h, msgs)
}

// A batch handler whose batch fails without saying which message is to
// blame: the batch is split until the bad message is alone; the others
// commit, and only it fails.
func TestBatchHandlerSplitsToFindTheFailingMessage(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchHandlerSplitsToFindTheFailingMessage[*sql.Tx], batchHandlerSplitsToFindTheFailingMessage[pgx.Tx])
}

func batchHandlerSplitsToFindTheFailingMessage[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	bad := errors.New("provider refused the batch")
	b := newBatchHandlerEnv(t, e, func(ctx context.Context, tx TTx, msgs []*message.Message, _ message.Publisher) error {
		for _, m := range msgs {
			if m.UUID == "bh-5" {
				return bad
			}
		}
		return e.insertAll(ctx, tx, msgs)
	})
	errs := b.deliver(orders(16, "bh")...)
	for i, err := range errs {
		if (i == 5) != errors.Is(err, bad) || (i != 5 && err != nil) {
			t.Fatalf("bh-%d: %v", i, err)
		}
	}
	if n := e.rows(t); n != 15 {
		t.Fatalf("charges=%d, want 15", n)
	}
	b.mu.Lock()
	runs := len(b.slices)
	b.mu.Unlock()
	// The whole batch, then halves down to the bad message: a handful of
	// runs, not one per message.
	if runs > 12 {
		t.Fatalf("%d runs of the batch function to isolate one message", runs)
	}
	// Delivered again: all duplicates but the bad one, which still fails,
	// and the function sees only it.
	b.mu.Lock()
	b.slices = nil
	b.mu.Unlock()
	errs = b.deliver(orders(16, "bh")...)
	for i, err := range errs {
		if (i == 5) != errors.Is(err, bad) || (i != 5 && err != nil) {
			t.Fatalf("again bh-%d: %v", i, err)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, s := range b.slices {
		if len(s) != 1 || s[0] != "bh-5" {
			t.Fatalf("second delivery: the batch function saw %v, want only bh-5 (duplicates filtered out)", s)
		}
	}
}

type charge struct {
	Cents int `json:"cents"`
}

// A typed batch handler with one payload that does not decode: that message
// fails with a permanent error (the poison middleware parks it), the rest
// commit without a split.
func TestTypedBatchHandlerPoisonsOneMessage(t *testing.T) {
	t.Parallel()
	onEachDriver(t, typedBatchHandlerPoisonsOneMessage[*sql.Tx], typedBatchHandlerPoisonsOneMessage[pgx.Tx])
}

func typedBatchHandlerPoisonsOneMessage[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	b := newBatchHandlerEnv(t, e, func(ctx context.Context, tx TTx, msgs []*message.Message, _ message.Publisher) error {
		for i, m := range msgs {
			if _, err := pipeline.Decode[charge](nil, m); err != nil {
				return pipeline.MessageFailed(i, err)
			}
		}
		return e.insertAll(ctx, tx, msgs)
	})
	var msgs []*message.Message
	for i := range 8 {
		payload := []byte(`{"cents": 100}`)
		if i == 2 {
			payload = []byte(`not json`)
		}
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("tb-%d", i), payload))
	}
	errs := b.deliver(msgs...)
	for i, err := range errs {
		if i == 2 {
			if !settle.IsPermanent(err) {
				t.Fatalf("tb-2: %v, want a permanent decode error", err)
			}
			continue
		}
		must(t, err)
	}
	if n := e.rows(t); n != 7 {
		t.Fatalf("charges=%d, want 7", n)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.slices) > 2 {
		t.Fatalf("%d runs; the named message should be taken out without a split", len(b.slices))
	}
}

// A delivery found busy in the first run of its batch and settled in a later
// run (the batch ran again without a failing message, and the holder's claim
// had lapsed by then) reports the later run's outcome, not "deferred".
func TestBatchOutcomeIsTheLastRunsOutcome(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchOutcomeIsTheLastRunsOutcome[*sql.Tx], batchOutcomeIsTheLastRunsOutcome[pgx.Tx])
}

func batchOutcomeIsTheLastRunsOutcome[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	// Someone else holds "held", for a moment: long enough for the first
	// run to find it busy on a loaded machine (at 300ms, a first run that
	// started late found it lapsed).
	const hold = 2 * time.Second
	_, err := e.store.Claim(t.Context(), "held", hold)
	must(t, err)
	b := newBatchEnv(t, e, func(msg *message.Message, call int) error {
		if msg.UUID == "slow" && call == 1 {
			time.Sleep(hold + 500*time.Millisecond) // the claim on "held" lapses meanwhile
			return errors.New("declined")
		}
		return nil
	})
	held, slow := message.NewMessage("held", []byte("held")), message.NewMessage("slow", []byte("slow"))
	var recs []*settlement.Record
	for _, m := range []*message.Message{held, slow} {
		ctx, rec := settlement.New(m.Context(), nil)
		m.SetContext(ctx)
		recs = append(recs, rec)
	}
	errs := b.deliver(held, slow)
	if errs[0] != nil || errs[1] == nil {
		t.Fatalf("held: %v, slow: %v; want held settled, slow failed", errs[0], errs[1])
	}
	b.mu.Lock()
	heldRuns := b.calls["held"]
	b.mu.Unlock()
	if heldRuns != 1 || e.rows(t) != 1 {
		t.Fatalf("held ran %d times, %d charges; want it run once, in the second run", heldRuns, e.rows(t))
	}
	if o, _, _, _ := recs[0].Snapshot(); o != "" || recs[0].Deferred() {
		t.Fatalf("held: outcome %q after it was done; want none set (the tracing middleware then reports done)", o)
	}
}

// outboxInserts installs a trigger on e's outbox table that stamps every row
// with the start time of the statement that inserted it, and returns a
// function counting the distinct statements that inserted rows. It skips
// SQLite, whose triggers cannot tell statements apart.
func outboxInserts[TTx any](t *testing.T, e *txEnv[TTx]) func() int {
	t.Helper()
	name := testenv.Name(t, "stamps")
	stamps := "st_" + name[len(name)-8:]
	table := e.db.quote(e.ob.Table())
	ctx := t.Context()
	var ddl []string
	switch e.db.Dialect() {
	case sqldb.Postgres:
		ddl = []string{
			"CREATE TABLE " + stamps + " (at TIMESTAMPTZ NOT NULL)",
			"CREATE FUNCTION " + stamps + "_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO " + stamps + " (at) VALUES (statement_timestamp()); RETURN NULL; END $$",
			"CREATE TRIGGER " + stamps + "_t AFTER INSERT ON " + table + " FOR EACH ROW EXECUTE FUNCTION " + stamps + "_f()",
		}
		t.Cleanup(func() {
			_, _ = e.db.sql.ExecContext(context.Background(), "DROP TRIGGER IF EXISTS "+stamps+"_t ON "+table)
			_, _ = e.db.sql.ExecContext(context.Background(), "DROP FUNCTION IF EXISTS "+stamps+"_f()")
		})
	case sqldb.MySQL:
		// NOW(6) in a trigger is the start of the statement that fired it.
		ddl = []string{
			"CREATE TABLE " + stamps + " (at DATETIME(6) NOT NULL)",
			"CREATE TRIGGER " + stamps + "_t AFTER INSERT ON " + table + " FOR EACH ROW INSERT INTO " + stamps + " (at) VALUES (NOW(6))",
		}
	default:
		t.Skip("SQLite triggers cannot tell statements apart")
	}
	t.Cleanup(func() { _, _ = e.db.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+stamps) })
	for _, s := range ddl {
		must(t, func() error { _, err := e.db.sql.ExecContext(ctx, s); return err }())
	}
	return func() int {
		var n int
		must(t, e.db.sql.QueryRowContext(t.Context(), "SELECT COUNT(DISTINCT at) FROM "+stamps).Scan(&n))
		return n
	}
}

// The outbox messages of a batch are written together, in one insert per
// transaction, not one per handler call.
func TestBatchWritesItsOutboxInOneInsert(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchWritesItsOutboxInOneInsert[*sql.Tx], batchWritesItsOutboxInOneInsert[pgx.Tx])
}

func batchWritesItsOutboxInOneInsert[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	inserts := outboxInserts(t, e)
	b := newBatchEnv(t, e, func(*message.Message, int) error { return nil })
	for i, err := range b.deliver(orders(16, "ob")...) {
		if err != nil {
			t.Fatalf("ob-%d: %v", i, err)
		}
	}
	if n, p := e.rows(t), e.pending(t); n != 16 || p != 16 {
		t.Fatalf("charges=%d outbox=%d, want 16 of each", n, p)
	}
	if n, txs := inserts(), b.transactions(); n != txs {
		t.Fatalf("%d outbox inserts for 16 messages in %d transactions, want one per transaction", n, txs)
	}
}

// A message whose outbox row cannot be written fails alone: the batch's
// outbox insert fails without naming it, so the batch is split until it is
// alone, and the others commit with their rows.
func TestBatchIsolatesAFailingOutboxRow(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchIsolatesAFailingOutboxRow[*sql.Tx], batchIsolatesAFailingOutboxRow[pgx.Tx])
}

func batchIsolatesAFailingOutboxRow[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	if e.db.Dialect() == sqldb.SQLite {
		t.Skip("SQLite cannot add a CHECK constraint to a table")
	}
	_, err := e.db.sql.ExecContext(t.Context(), "ALTER TABLE "+e.db.quote(e.ob.Table())+
		" ADD CONSTRAINT "+e.db.quote("no_bad_"+e.ob.Table())+" CHECK (uuid <> 'receipt-obf-5')")
	must(t, err)
	b := newBatchEnv(t, e, func(*message.Message, int) error { return nil })
	errs := b.deliver(orders(16, "obf")...)
	for i, err := range errs {
		switch {
		case i == 5 && err == nil:
			t.Fatal("obf-5 settled, want its outbox insert's error")
		case i != 5 && err != nil:
			t.Fatalf("obf-%d: %v", i, err)
		}
	}
	if n, p := e.rows(t), e.pending(t); n != 15 || p != 15 {
		t.Fatalf("charges=%d outbox=%d, want 15 of each (all but the failing one)", n, p)
	}
}

// A batch's transaction begins when its first delivery arrives, before the
// keys are known. A batch in which no message has a key runs nothing, and
// must give that transaction back: the connection is free afterwards and
// the next batch commits.
func TestBatchWithoutKeysEndsItsTransaction(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchWithoutKeysEndsItsTransaction[*sql.Tx], batchWithoutKeysEndsItsTransaction[pgx.Tx])
}

func batchWithoutKeysEndsItsTransaction[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob, Store: e.store,
		Key: keyUnlessMarked, Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 50 * time.Millisecond}},
		e.charge(nil))
	must(t, err)
	deliverWithoutKeys(t, h)
	if n := e.db.inUse(); n != 0 {
		t.Fatalf("%d connections in use after a batch without keys, want 0: its transaction was left open", n)
	}
	for i, err := range deliverAll(h, orders(4, "haskey")) {
		if err != nil {
			t.Fatalf("haskey-%d: %v", i, err)
		}
	}
	if n := e.rows(t); n != 4 {
		t.Fatalf("charges=%d, want 4", n)
	}
}

// On SQLite a batch begins its transaction when it starts, not when its
// first delivery arrives: settle's SQLite URLs begin IMMEDIATE, and a batch
// waiting for more deliveries must not hold the database's write lock while
// it waits.
func TestSQLiteBatchDoesNotLockWhileItFills(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "settle.db")
	db, dialect, err := sqlurl.Open("sqlite://" + path)
	must(t, err)
	t.Cleanup(func() { _ = db.Close() })
	e := newTxEnv(t, stdOf(testenv.DB{DB: db, Dialect: dialect}))
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Outbox: e.ob, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 500 * time.Millisecond}}, e.charge(nil))
	must(t, err)
	done := make(chan error, 1)
	go func() { done <- h(message.NewMessage("alone-1", []byte("alone-1"))) }()
	time.Sleep(100 * time.Millisecond) // the batch waits for three more

	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(50)")
	must(t, err)
	defer other.Close()
	if _, err := other.ExecContext(t.Context(), "INSERT INTO "+e.charges+" (order_id, cents) VALUES ('other', 1)"); err != nil {
		t.Fatalf("another writer while a batch fills: %v; the batch holds the write lock", err)
	}
	must(t, <-done)
	if n := e.rows(t); n != 2 {
		t.Fatalf("charges=%d, want 2 (the batch's and the other writer's)", n)
	}
}

// A key function that panics on one message of a batch fails that message
// alone, with the panic as its error; the rest of the batch commits, and no
// delivery is left waiting.
func TestBatchContainsAPanickingKeyFunction(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchContainsAPanickingKeyFunction[*sql.Tx], batchContainsAPanickingKeyFunction[pgx.Tx])
}

func batchContainsAPanickingKeyFunction[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: e.db.Driver, Outbox: e.ob, Store: e.store,
		Key: func(msg *message.Message) (string, error) {
			if msg.UUID == "keypanic-2" {
				panic("no key for you")
			}
			return msg.UUID, nil
		},
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 50 * time.Millisecond}},
		e.charge(nil))
	must(t, err)
	done := make(chan []error, 1)
	go func() { done <- deliverAll(h, orders(8, "keypanic")) }()
	var errs []error
	select {
	case errs = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("deliveries still waiting 20s after a key function panicked in their batch")
	}
	for i, err := range errs {
		var hp *middleware.PanicError
		switch {
		case i == 2 && !errors.As(err, &hp):
			t.Errorf("keypanic-2: %v, want a middleware.PanicError", err)
		case i != 2 && err != nil:
			t.Errorf("keypanic-%d: %v", i, err)
		}
	}
	if n := e.rows(t); n != 7 {
		t.Fatalf("charges=%d, want 7 (all but the message without a key)", n)
	}
}

var errNoKey = errors.New("no key")

// keyUnlessMarked is a key function that has no key for a message marked
// "nokey".
func keyUnlessMarked(msg *message.Message) (string, error) {
	if msg.Metadata.Get("nokey") != "" {
		return "", errNoKey
	}
	return msg.UUID, nil
}

// deliverWithoutKeys delivers a batch of four messages none of which has a
// key (see keyUnlessMarked), and checks that each fails with that.
func deliverWithoutKeys(t *testing.T, h message.NoPublishHandlerFunc) {
	t.Helper()
	msgs := orders(4, "nokey")
	for _, m := range msgs {
		m.Metadata.Set("nokey", "1")
	}
	for i, err := range deliverAll(h, msgs) {
		if !errors.Is(err, errNoKey) {
			t.Fatalf("nokey-%d: %v, want the key function's error", i, err)
		}
	}
}

// inFlight is a subscriber that says it hands its router n deliveries of a
// subscription at once, as amqpsub.Subscriber does; it is never subscribed
// to here.
type inFlight struct {
	competing
	n int
}

func (s inFlight) InFlight() int { return s.n }

// A batch is the deliveries in flight: with Concurrency 1, a batch handler
// is refused on a subscriber that hands its router one delivery at a time,
// and accepted on one that says it has several in flight.
func TestBatchNeedsDeliveriesInFlight(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, stdOf(testenv.SQLite(t)))
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: competingPublisher{}, Store: e.store, Concurrency: 1})
	must(t, err)
	fn := func(context.Context, *sql.Tx, []*message.Message, message.Publisher) error { return nil }
	cfg := pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver, Batch: pipeline.BatchConfig{MaxSize: 8}}
	if _, err := pipeline.HandleBatchTx(p, "one", "orders", competing{}, cfg, fn); err == nil || !strings.Contains(err.Error(), "in flight") {
		t.Fatalf("HandleBatchTx with one delivery in flight = %v; want it refused", err)
	}
	if _, err := pipeline.HandleBatchTx(p, "many", "orders", inFlight{n: 8}, cfg, fn); err != nil {
		t.Fatalf("HandleBatchTx on a subscriber with 8 in flight: %v", err)
	}
}

// competingPublisher is a publisher for the parking topics that no message
// reaches.
type competingPublisher struct{}

func (competingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("unexpected publish")
}
func (competingPublisher) Close() error { return nil }
