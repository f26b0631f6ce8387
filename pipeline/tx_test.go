package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

type txEnv struct {
	db      testenv.DB
	claims  string // the claims table
	store   *dedupe.SQLStore[*sql.Tx]
	ob      *outbox.Outbox[*sql.Tx]
	charges string
}

func newTxEnv(t *testing.T, db testenv.DB) *txEnv {
	t.Helper()
	claims := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: claims})
	must(t, err)
	name := testenv.Name(t, "tx")
	topic := "ob_" + name[len(name)-8:]
	ob, err := outbox.New(outbox.Config{Dialect: db.Dialect, Topic: topic})
	must(t, err)
	must(t, ob.InitSchema(t.Context(), db.DB))
	charges := "charges_" + name[len(name)-8:]
	_, err = db.ExecContext(t.Context(), "CREATE TABLE "+charges+" (order_id VARCHAR(64) PRIMARY KEY, cents INTEGER NOT NULL)")
	must(t, err)
	t.Cleanup(func() {
		for _, tbl := range []string{charges, quote(db, topic), quote(db, topic+"_relays")} {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+tbl)
		}
	})
	return &txEnv{db: db, claims: claims, store: store, ob: ob, charges: charges}
}

func quote(db testenv.DB, s string) string {
	if db.Dialect == sqldb.MySQL {
		return "`" + s + "`"
	}
	return `"` + s + `"`
}

func (e *txEnv) ph(n int) string {
	if e.db.Dialect == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func (e *txEnv) rows(t *testing.T) int {
	t.Helper()
	var n int
	must(t, e.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+e.charges).Scan(&n))
	return n
}

func (e *txEnv) pending(t *testing.T) int64 {
	t.Helper()
	st, err := e.ob.Status(t.Context(), e.db.DB)
	must(t, err)
	return st.Pending
}

// handler is the stack a user writes: dedupe middleware, then the
// transactional handler.
func (e *txEnv) handler(t *testing.T, fn pipeline.TxFunc) message.HandlerFunc {
	t.Helper()
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second})
	must(t, err)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob}, fn)
	must(t, err)
	return dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
}

func (e *txEnv) charge(fail error) pipeline.TxFunc {
	return func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
		if _, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+e.ph(1)+", "+e.ph(2)+")", string(msg.Payload), 1999); err != nil {
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

func newTxEnvOn(t *testing.T, db testenv.DB) *txEnv { return newTxEnv(t, db) }

func forEachDB(t *testing.T, fn func(t *testing.T, e *txEnv)) {
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			fn(t, newTxEnv(t, d.Open(t)))
		})
	}
}

func TestTxHandlerCommitsWritesOutboxAndConfirmTogether(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *txEnv) {
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
		n, err := e.ob.Forward(t.Context(), e.db.DB, ps, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil || n != 1 {
			t.Fatalf("Forward = %d, %v; want 1", n, err)
		}
		if m := <-receipts; m.UUID != "receipt-order-msg-1" {
			t.Fatalf("receipt %s", m.UUID)
		}
	})
}

func TestTxHandlerRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *txEnv) {
		declined := errors.New("card declined")
		h := e.handler(t, e.charge(declined))
		_, err := h(message.NewMessage("order-msg-2", []byte("A-18")))
		if !errors.Is(err, declined) {
			t.Fatalf("err = %v, want the handler's error", err)
		}
		if n, p := e.rows(t), e.pending(t); n != 0 || p != 0 {
			t.Fatalf("after rollback charges=%d outbox=%d; want none", n, p)
		}
		// The claim was released, and the failed attempt still counts.
		c, err := e.store.Claim(t.Context(), "order-msg-2", time.Minute)
		must(t, err)
		if c.Result != dedupe.Acquired || c.Attempt != 2 {
			t.Fatalf("claim after rollback = %+v; want acquired as attempt 2", c)
		}
	})
}

// The commit's error is the handler's result: a deferred constraint makes
// the commit itself fail on PostgreSQL.
func TestTxHandlerReturnsCommitError(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, testenv.Postgres(t))
	uniq := "uniq_" + e.charges
	_, err := e.db.ExecContext(t.Context(), "CREATE TABLE "+uniq+" (k INT, CONSTRAINT "+uniq+"_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
	must(t, err)
	t.Cleanup(func() { _, _ = e.db.ExecContext(context.Background(), "DROP TABLE "+uniq) })
	var calls atomic.Int64
	h := e.handler(t, func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
		calls.Add(1)
		if err := e.charge(nil)(ctx, tx, msg, out); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, "INSERT INTO "+uniq+" VALUES (1), (1)") // fails only at commit
		return err
	})
	_, err = h(message.NewMessage("order-msg-3", []byte("A-19")))
	if err == nil || calls.Load() != 1 {
		t.Fatalf("err = %v after %d calls; want the commit's error", err, calls.Load())
	}
	if n, p := e.rows(t), e.pending(t); n != 0 || p != 0 {
		t.Fatalf("after a failed commit charges=%d outbox=%d; want none", n, p)
	}
	c, err := e.store.Claim(t.Context(), "order-msg-3", time.Minute)
	must(t, err)
	if c.Result != dedupe.Acquired {
		t.Fatalf("claim after failed commit = %+v; want it released", c)
	}
}

func TestTxHandlerNeedsTheDedupeMiddleware(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, testenv.SQLite(t))
	h, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob}, e.charge(nil))
	must(t, err)
	err = h(message.NewMessage("m", []byte("A-20")))
	if !errors.Is(err, dedupe.ErrNoClaim) {
		t.Fatalf("err = %v, want ErrNoClaim", err)
	}
	if n := e.rows(t); n != 0 {
		t.Fatalf("%d charges written without a claim", n)
	}
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig{}, e.charge(nil)); err == nil {
		t.Fatal("NewTxHandler without DB succeeded")
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// One statement per message: the claim is written as confirmed inside the
// transaction, without the dedupe middleware.
func TestTxHandlerOneStatement(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *txEnv) {
		declined := errors.New("card declined")
		var fail atomic.Bool
		fail.Store(true)
		h, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob, OneStatement: true, Store: e.store},
			func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
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
	})
	if _, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: &sql.DB{}, OneStatement: true}, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil }); err == nil || !strings.Contains(err.Error(), "TxConfig.Store") {
		t.Fatalf("OneStatement without a store: %v", err)
	}
}
