package pipeline_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// The handlers of these tests do what a careful Go programmer does: they
// derive a context with a deadline of their own, cancel it when they return,
// and give it to the messages they publish through the outbox
// (m.SetContext). With group commit the outbox rows are written after the
// handler has returned, so settle must not write them under the handler's
// context.

// derivedCharge is e.charge (one charge row, one receipt on the outbox
// carrying the handler's context) run under a context derived from the
// handler's and cancelled when it returns.
func derivedCharge(e *txEnv) pipeline.TxFunc {
	return func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		return e.charge(nil)(ctx, tx, msg, out)
	}
}

// derivedBatchCharge is the batch function of derivedCharge: every charge
// in one statement, one receipt per message, all under a context derived
// from the batch's and cancelled when it returns.
func derivedBatchCharge(e *txEnv) pipeline.BatchTxFunc {
	return func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := e.insertAll(ctx, tx, msgs); err != nil {
			return err
		}
		for _, m := range msgs {
			r := message.NewMessage("receipt-"+m.UUID, m.Payload)
			r.SetContext(ctx)
			if err := out.Publish("receipts", r); err != nil {
				return err
			}
		}
		return nil
	}
}

// outboxRows counts the outbox table's rows, forwarded or not.
func (e *txEnv) outboxRows(t *testing.T) int {
	t.Helper()
	var n int
	must(t, e.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+quote(e.db, e.ob.Table())).Scan(&n))
	return n
}

// checkCharged requires every delivery to have succeeded, n charges, n
// outbox rows and every key confirmed.
func checkCharged(t *testing.T, errs []error, charges, rows int, confirmed func(key string) bool, msgs []*message.Message) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s: %v", msgs[i].UUID, err)
		}
	}
	n := len(msgs)
	if charges != n || rows != n {
		t.Errorf("charges=%d outbox rows=%d, want %d of each", charges, rows, n)
	}
	for _, m := range msgs {
		if !confirmed(m.UUID) {
			t.Errorf("key %s is not confirmed", m.UUID)
		}
	}
}

func (e *txEnv) confirmed(t *testing.T) func(string) bool {
	return func(key string) bool {
		c, err := e.store.Claim(t.Context(), key, time.Minute)
		must(t, err)
		if c.Result == dedupe.Acquired {
			must(t, e.store.Release(t.Context(), c))
		}
		return c.Result == dedupe.Duplicate
	}
}

// Group commit, per-message handlers (TxConfig.Batch) and batch functions
// (NewBatchTxHandler), on every database: a handler that cancels the context
// it gave its outbox messages still has every message done, once.
func TestBatchOutboxOutlivesTheHandlersContext(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *txEnv) {
		batch := pipeline.BatchConfig{MaxSize: 8, MaxWait: 200 * time.Millisecond}
		// OneStatement writes its outbox rows while the handler runs; it is
		// here to show the modes agree.
		one, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob, Store: e.store, OneStatement: true}, derivedCharge(e))
		must(t, err)
		perMessage, err := pipeline.NewTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob, Store: e.store, Batch: batch}, derivedCharge(e))
		must(t, err)
		batchFn, err := pipeline.NewBatchTxHandler(pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob, Store: e.store, Batch: batch}, derivedBatchCharge(e))
		must(t, err)
		var all []*message.Message
		for _, c := range []struct {
			name string
			h    message.NoPublishHandlerFunc
		}{{"one-statement", one}, {"batch", perMessage}, {"batch-function", batchFn}} {
			msgs := orders(8, c.name)
			all = append(all, msgs...)
			errs := deliverAll(c.h, msgs)
			for i, err := range errs {
				if err != nil {
					t.Errorf("%s: %s: %v", c.name, msgs[i].UUID, err)
				}
			}
		}
		checkCharged(t, nil, e.rows(t), e.outboxRows(t), e.confirmed(t), all)
	})
}

// derivedPgxCharge is derivedCharge on pgx, with an outbox.
func derivedPgxCharge(e *pgxEnv) pipeline.PgxTxFunc {
	return func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if _, err := tx.Exec(ctx, `INSERT INTO "`+e.charges+`" (order_id) VALUES ($1)`, string(msg.Payload)); err != nil {
			return err
		}
		r := message.NewMessage("receipt-"+msg.UUID, msg.Payload)
		r.SetContext(ctx)
		return out.Publish("receipts", r)
	}
}

// derivedPgxBatchCharge is derivedBatchCharge on pgx.
func derivedPgxBatchCharge(e *pgxEnv) pipeline.PgxBatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := e.insertAll(ctx, tx, msgs, nil); err != nil {
			return err
		}
		for _, m := range msgs {
			r := message.NewMessage("receipt-"+m.UUID, m.Payload)
			r.SetContext(ctx)
			if err := out.Publish("receipts", r); err != nil {
				return err
			}
		}
		return nil
	}
}

func (e *pgxEnv) confirmed(t *testing.T) func(string) bool {
	return func(key string) bool {
		c, err := e.store.Claim(t.Context(), key, time.Minute)
		must(t, err)
		if c.Result == dedupe.Acquired {
			must(t, e.store.Release(t.Context(), c))
		}
		return c.Result == dedupe.Duplicate
	}
}

// The pgx twin of TestBatchOutboxOutlivesTheHandlersContext.
func TestPgxBatchOutboxOutlivesTheHandlersContext(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	ob := newPgxOutbox(t, e.pool)
	batch := pipeline.BatchConfig{MaxSize: 8, MaxWait: 200 * time.Millisecond}
	one, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, Outbox: ob, Store: e.store, OneStatement: true}, derivedPgxCharge(e))
	must(t, err)
	perMessage, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, Outbox: ob, Store: e.store, Batch: batch}, derivedPgxCharge(e))
	must(t, err)
	batchFn, err := pipeline.NewPgxBatchTxHandler(pipeline.PgxTxConfig{DB: e.pool, Outbox: ob, Store: e.store, Batch: batch}, derivedPgxBatchCharge(e))
	must(t, err)
	var all []*message.Message
	for _, c := range []struct {
		name string
		h    message.NoPublishHandlerFunc
	}{{"one-statement", one}, {"batch", perMessage}, {"batch-function", batchFn}} {
		msgs := orders(8, c.name)
		all = append(all, msgs...)
		for i, err := range deliverAll(c.h, msgs) {
			if err != nil {
				t.Errorf("%s: %s: %v", c.name, msgs[i].UUID, err)
			}
		}
	}
	var rows int
	must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*) FROM "`+ob.Table()+`"`).Scan(&rows))
	checkCharged(t, nil, len(e.all(t)), rows, e.confirmed(t), all)
}

// The reproduction, through the whole pipeline: RabbitMQ via
// amqpsub (8 deliveries of one subscription in flight), HandleTx with Batch
// and HandleBatchTx (HandlePgxTx and HandlePgxBatchTx on pgx), handlers that
// cancel the context of their outbox messages. Every order is charged once
// with its receipt in the outbox, and nothing is dead-lettered or poisoned.
func TestBatchHandlersContextThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	type setup func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (charges, rows func() int)
	sqlSetup := func(open func(testing.TB) testenv.DB, batchFn bool) setup {
		return func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (func() int, func() int) {
			e := newTxEnv(t, open(t))
			cfg := pipeline.TxConfig{DB: e.db.DB, Outbox: e.ob, Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 20 * time.Millisecond}}
			var err error
			if batchFn {
				_, err = p.HandleBatchTx("charge", src, sub, e.store, cfg, derivedBatchCharge(e))
			} else {
				_, err = p.HandleTx("charge", src, sub, e.store, cfg, derivedCharge(e))
			}
			must(t, err)
			return func() int { return e.rows(t) }, func() int { return e.outboxRows(t) }
		}
	}
	pgxSetup := func(batchFn bool) setup {
		return func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (func() int, func() int) {
			e := newPgxEnv(t)
			ob := newPgxOutbox(t, e.pool)
			cfg := pipeline.PgxTxConfig{DB: e.pool, Outbox: ob, Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 20 * time.Millisecond}}
			var err error
			if batchFn {
				_, err = p.HandlePgxBatchTx("charge", src, sub, e.store, cfg, derivedPgxBatchCharge(e))
			} else {
				_, err = p.HandlePgxTx("charge", src, sub, e.store, cfg, derivedPgxCharge(e))
			}
			must(t, err)
			rows := func() int {
				var n int
				must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*) FROM "`+ob.Table()+`"`).Scan(&n))
				return n
			}
			return func() int { return len(e.all(t)) }, rows
		}
	}
	for _, c := range []struct {
		name  string
		setup setup
	}{
		{"sqlite/batch", sqlSetup(testenv.SQLite, false)},
		{"postgres/batch", sqlSetup(testenv.Postgres, false)},
		{"postgres/batch-function", sqlSetup(testenv.Postgres, true)},
		{"mysql/batch", sqlSetup(testenv.MySQL, false)},
		{"mysql/batch-function", sqlSetup(testenv.MySQL, true)},
		{"pgx/batch", pgxSetup(false)},
		{"pgx/batch-function", pgxSetup(true)},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a := newBatchAMQP(t, "ctx")
			sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: a.cfg, InFlight: 8}, nil)
			must(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			must(t, err)
			p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Retry: fastRetry(), DisableTracing: true,
				BusyDelay: 20 * time.Millisecond})
			must(t, err)
			charges, rows := c.setup(t, p, a.src, sub)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			t.Cleanup(func() {
				must(t, router.Close())
				must(t, <-done)
			})
			const n = 8
			a.publishOrders(t, "ctx", n)
			parked := func() int { return a.depth(t, a.src+".dead_letter") + a.depth(t, a.src+".poison") }
			deadline := time.Now().Add(30 * time.Second)
			for charges()+parked() < n && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(300 * time.Millisecond) // anything doubled arrives by then
			ch, r := charges(), rows()
			dl, ps := a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison")
			if ch != n || r != n || dl != 0 || ps != 0 {
				t.Fatalf("charges=%d outbox rows=%d dead-lettered=%d poisoned=%d; want %d charges and %d rows, none parked",
					ch, r, dl, ps, n, n)
			}
		})
	}
}
