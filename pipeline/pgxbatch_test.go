package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// The cases of this file use what pgx alone has (pgx.Batch, CopyFrom);
// every other case runs on each driver (onEachDriver).

// pgxEnv is a claims table and a charges table on PostgreSQL, used through
// a pgx pool. charges has no key on order_id, so an effect done twice shows
// as two rows.
type pgxEnv struct {
	pool    *pgxpool.Pool
	db      sqldb.Driver[pgx.Tx]
	store   *dedupe.SQLStore[pgx.Tx]
	charges string
}

func newPgxEnv(t *testing.T) *pgxEnv {
	t.Helper()
	pool := testenv.PgxPool(t)
	d := db[pgx.Tx]{Driver: sqldb.Pgx(pool), sql: testenv.Postgres(t)}
	charges := testenv.Name(t, "charges")
	d.exec(t, `CREATE TABLE "`+charges+`" (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)`)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+charges+`"`) })
	return &pgxEnv{pool: pool, db: d.Driver, store: claimsTable(t, d), charges: charges}
}

func (e *pgxEnv) rows(t *testing.T, orderID string) int {
	t.Helper()
	var n int
	must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*) FROM "`+e.charges+`" WHERE order_id = $1`, orderID).Scan(&n))
	return n
}

// pgxBatchEnv is a pgx batch handler on PostgreSQL that records the
// messages of every run of its function.
type pgxBatchEnv struct {
	*pgxEnv
	ob *outbox.Outbox[pgx.Tx] // nil unless withOutbox
	h  message.NoPublishHandlerFunc

	mu   sync.Mutex
	runs [][]string // the UUIDs each run of the function saw
}

// newPgxBatchEnv builds a batch handler around fn; with an outbox, it is
// created and bound to the handler.
func newPgxBatchEnv(t *testing.T, withOutbox bool, fn pipeline.BatchTxFunc[pgx.Tx]) *pgxBatchEnv {
	t.Helper()
	b := &pgxBatchEnv{pgxEnv: newPgxEnv(t)}
	if withOutbox {
		b.ob = newPgxOutbox(t, b.pool)
	}
	h, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[pgx.Tx]{DB: b.db, Store: b.store, Outbox: b.ob,
		Batch: pipeline.BatchConfig{MaxSize: 16, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
			ids := make([]string, len(msgs))
			for i, m := range msgs {
				ids[i] = m.UUID
			}
			b.mu.Lock()
			b.runs = append(b.runs, ids)
			b.mu.Unlock()
			return fn(ctx, tx, msgs, out)
		})
	must(t, err)
	b.h = h
	return b
}

// newPgxOutbox is a PostgreSQL outbox on pool with its own table, dropped
// at the end of the test.
func newPgxOutbox(t *testing.T, pool *pgxpool.Pool) *outbox.Outbox[pgx.Tx] {
	t.Helper()
	name := testenv.Name(t, "ob")
	ob, err := outbox.New(sqldb.Pgx(pool), outbox.Config{Topic: "ob_" + name[len(name)-8:]})
	must(t, err)
	must(t, ob.InitSchema(t.Context()))
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+ob.Table()+`", "`+ob.Table()+`_relays"`)
	})
	return ob
}

func (b *pgxBatchEnv) takeRuns() [][]string {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.runs
	b.runs = nil
	return r
}

// all returns every charge row's order_id, sorted.
func (e *pgxEnv) all(t *testing.T) []string {
	t.Helper()
	rows, err := e.pool.Query(t.Context(), `SELECT order_id FROM "`+e.charges+`" ORDER BY order_id`)
	must(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	must(t, err)
	return ids
}

// insertAll writes one charge per message and one outbox message (when out
// is set) per message, every charge in one round trip (a pgx.Batch).
func (e *pgxEnv) insertAll(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
	var batch pgx.Batch
	for _, m := range msgs {
		batch.Queue(`INSERT INTO "`+e.charges+`" (order_id) VALUES ($1)`, string(m.Payload))
	}
	if err := tx.SendBatch(ctx, &batch).Close(); err != nil {
		return err
	}
	if out == nil {
		return nil
	}
	for _, m := range msgs {
		if err := out.Publish("receipts", message.NewMessage("receipt-"+m.UUID, m.Payload)); err != nil {
			return err
		}
	}
	return nil
}

// claimed reports whether key is in the claims table, by taking it: a key
// the table never saw is acquired at its first attempt (and released).
func (e *pgxEnv) claimed(t *testing.T, key string) bool {
	t.Helper()
	c, err := e.store.Claim(t.Context(), key, time.Minute)
	must(t, err)
	if c.Result == dedupe.Acquired {
		must(t, e.store.Release(t.Context(), c))
		return c.Attempt != 1
	}
	return true
}

// One message of a pgx batch fails: named (MessageFailed) or not (the
// batch is split to find it), the others commit together with their outbox
// rows, only it is retried, and its retry does the work once.
func TestPgxBatchHandlerIsolatesAFailingMessage(t *testing.T) {
	t.Parallel()
	for _, named := range []bool{true, false} {
		t.Run(map[bool]string{true: "named", false: "split"}[named], func(t *testing.T) {
			t.Parallel()
			declined := errors.New("card declined")
			var failing sync.Map // UUIDs that fail while present
			failing.Store("pb-5", true)
			var b *pgxBatchEnv
			b = newPgxBatchEnv(t, true, func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
				// The writes come first, so a failure has something to undo.
				if err := b.insertAll(ctx, tx, msgs, out); err != nil {
					return err
				}
				for i, m := range msgs {
					if _, ok := failing.Load(m.UUID); ok {
						if named {
							return pipeline.MessageFailed(i, declined)
						}
						return declined
					}
				}
				return nil
			})
			errs := deliverAll(b.h, orders(12, "pb"))
			for i, err := range errs {
				if (i == 5) != errors.Is(err, declined) || (i != 5 && err != nil) {
					t.Fatalf("pb-%d: %v", i, err)
				}
			}
			want := []string{}
			for i := range 12 {
				if i != 5 {
					want = append(want, fmt.Sprintf("pb-%d", i))
				}
			}
			sort.Strings(want)
			if got := b.all(t); !slices.Equal(got, want) {
				t.Fatalf("charges %v, want all but pb-5 once", got)
			}
			if p := pgxPending(t, b.ob); p != 11 {
				t.Fatalf("%d outbox rows, want 11: pb-5's rolled back with its run", p)
			}
			if b.claimed(t, "pb-5") {
				t.Fatal("pb-5 failed but its key is in the claims table")
			}
			runs := b.takeRuns()
			if len(runs) > 12 {
				t.Fatalf("%d runs to isolate one message of 12", len(runs))
			}
			// Redelivered with pb-5 now passing: only pb-5 reaches the
			// function, and it is done once.
			failing.Delete("pb-5")
			for _, err := range deliverAll(b.h, orders(12, "pb")) {
				must(t, err)
			}
			for _, r := range b.takeRuns() {
				if !slices.Equal(r, []string{"pb-5"}) {
					t.Fatalf("redelivery: the function saw %v, want only pb-5", r)
				}
			}
			if n := b.rows(t, "pb-5"); n != 1 {
				t.Fatalf("pb-5: %d charges after its retry, want 1", n)
			}
			if p := pgxPending(t, b.ob); p != 12 {
				t.Fatalf("%d outbox rows, want 12", p)
			}
		})
	}
}

func pgxPending(t *testing.T, ob *outbox.Outbox[pgx.Tx]) int64 {
	t.Helper()
	st, err := ob.Status(t.Context())
	must(t, err)
	return st.Pending
}

// A pgx transaction rolled back leaves no claim, no effect and no outbox
// row: the batch handler's own (every run of the batch fails), and a
// caller's own pgx.Tx carrying the same claims and outbox publisher.
func TestPgxBatchRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	t.Run("batch", func(t *testing.T) {
		t.Parallel()
		down := errors.New("ledger down")
		var b *pgxBatchEnv
		b = newPgxBatchEnv(t, true, func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
			if err := b.insertAll(ctx, tx, msgs, out); err != nil {
				return err
			}
			return down
		})
		for i, err := range deliverAll(b.h, orders(4, "pr")) {
			if !errors.Is(err, down) {
				t.Fatalf("pr-%d: %v, want the function's error", i, err)
			}
		}
		if got := b.all(t); len(got) != 0 {
			t.Fatalf("charges after rolled-back runs: %v", got)
		}
		if p := pgxPending(t, b.ob); p != 0 {
			t.Fatalf("%d outbox rows after rolled-back runs", p)
		}
		for i := range 4 {
			if key := fmt.Sprintf("pr-%d", i); b.claimed(t, key) {
				t.Fatalf("%s is in the claims table after its runs rolled back", key)
			}
		}
	})
	t.Run("callers-tx", func(t *testing.T) {
		t.Parallel()
		e := newPgxEnv(t)
		ob := newPgxOutbox(t, e.pool)
		ctx := t.Context()
		for _, commit := range []bool{false, true} {
			tx, err := e.pool.Begin(ctx)
			must(t, err)
			claims, err := e.store.WithTx(tx).ClaimConfirmedAll(ctx, []string{"own-a", "own-b"})
			must(t, err)
			for _, c := range claims {
				if c.Result != dedupe.Acquired {
					t.Fatalf("claims in the caller's tx: %+v", claims)
				}
			}
			out, err := ob.TxPublisher(tx)
			must(t, err)
			msgs := []*message.Message{message.NewMessage("own-a", []byte("own-a")), message.NewMessage("own-b", []byte("own-b"))}
			must(t, e.insertAll(ctx, tx, msgs, out))
			if commit {
				must(t, tx.Commit(ctx))
				break
			}
			must(t, tx.Rollback(ctx))
			if got, p := e.all(t), pgxPending(t, ob); len(got) != 0 || p != 0 {
				t.Fatalf("rolled back: charges %v, %d outbox rows; want none", got, p)
			}
			for _, k := range []string{"own-a", "own-b"} {
				if e.claimed(t, k) {
					t.Fatalf("rolled back: %s is claimed", k)
				}
			}
		}
		if got, p := e.all(t), pgxPending(t, ob); len(got) != 2 || p != 2 {
			t.Fatalf("committed: charges %v, %d outbox rows; want two of each", got, p)
		}
		for _, k := range []string{"own-a", "own-b"} {
			if c, err := e.store.Claim(ctx, k, time.Minute); err != nil || c.Result != dedupe.Duplicate {
				t.Fatalf("committed: %s claim = %+v, %v; want duplicate", k, c, err)
			}
		}
	})
}

// HandleBatchTx on pgx and RabbitMQ: competing subscriptions feed batches
// written with a pgx.Batch; every order (each published twice) is charged
// once, its receipt goes through the outbox and is forwarded by the relay
// (which LISTENs on pgx) once, and batches of more than one message really
// formed.
func TestPipelineHandleBatchTxOnPgxAndRabbitMQ(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	ob := newPgxOutbox(t, e.pool)
	a := newBatchAMQP(t, "pgxsrc")
	pub, sub, src := a.pub, a.sub, a.src

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: e.store, Concurrency: 4,
		Retry: fastRetry(), DisableTracing: true})
	must(t, err)
	var mu sync.Mutex
	biggest := 0
	_, err = pipeline.HandleBatchTx(p, "charge", src, sub,
		pipeline.TxConfig[pgx.Tx]{DB: e.db, Outbox: ob, Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
			mu.Lock()
			biggest = max(biggest, len(msgs))
			mu.Unlock()
			return e.insertAll(ctx, tx, msgs, out)
		})
	must(t, err)

	// The relay forwards the receipts to an in-process topic.
	receipts := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 128, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = receipts.Close() })
	relay, err := ob.NewRelay(receipts, outbox.RelayConfig{PollInterval: 50 * time.Millisecond})
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	relayDone, routerDone := make(chan error, 1), make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		cancel()
		must(t, <-routerDone)
		must(t, <-relayDone)
		must(t, relay.Close())
	})
	got, err := receipts.Subscribe(t.Context(), "receipts")
	must(t, err)

	const n = 40
	for i := range n {
		id := fmt.Sprintf("pq-%d", i)
		must(t, pub.Publish(src, message.NewMessage(id, []byte(id)), message.NewMessage(id, []byte(id))))
	}
	forwarded := map[string]int{}
	timeout := time.After(30 * time.Second)
	for len(forwarded) < n {
		select {
		case r := <-got:
			forwarded[r.UUID]++
			r.Ack()
		case <-timeout:
			t.Fatalf("%d of %d receipts forwarded", len(forwarded), n)
		}
	}
	waitFor(t, "the outbox drained", func() bool { return pgxPending(t, ob) == 0 })
	// Anything doubled would have arrived by now.
	time.Sleep(200 * time.Millisecond)
	select {
	case r := <-got:
		forwarded[r.UUID]++
		r.Ack()
	default:
	}
	for i := range n {
		id := fmt.Sprintf("pq-%d", i)
		if c := e.rows(t, id); c != 1 {
			t.Fatalf("%s: %d charges, want 1", id, c)
		}
		if c := forwarded["receipt-"+id]; c != 1 {
			t.Fatalf("receipt of %s forwarded %d times, want 1", id, c)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if biggest < 2 {
		t.Fatalf("the largest batch held %d message(s); batching did not happen", biggest)
	}
}

// A batch handler on pgx: the orders in flight are charged with one COPY in
// one transaction, with their dedupe keys written in one statement beside
// it; a payload that does not decode is named (MessageFailed) and poisoned
// alone. It needs a PostgreSQL server, so it is compiled but not run.
func ExampleNewBatchTxHandler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/shop")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	db := sqldb.Pgx(pool)
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{})
	if err != nil {
		panic(err)
	}
	charge, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[pgx.Tx]{
		DB: db, Store: store,
		Batch: pipeline.BatchConfig{MaxSize: 32},
	}, func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, _ message.Publisher) error {
		rows := make([][]any, len(msgs))
		for i, msg := range msgs {
			o, err := pipeline.Decode[OrderPlaced](nil, msg)
			if err != nil {
				return pipeline.MessageFailed(i, err)
			}
			rows[i] = []any{o.Body.ID, o.Body.Cents}
		}
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"charges"}, []string{"order_id", "cents"}, pgx.CopyFromRows(rows))
		return err
	})
	if err != nil {
		panic(err)
	}
	// With a pipeline, pipeline.HandleBatchTx adds it behind the whole
	// stack; on its own it is a router handler of competing subscriptions.
	_ = charge
}

// competing is a subscriber that is never subscribed to: a stand-in for a
// broker with competing consumers, which Concurrency 2 needs when a handler
// is added (GoChannel is refused).
type competing struct{}

func (competing) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	return nil, errors.New("not subscribed in this test")
}
func (competing) Close() error { return nil }

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
