package pipeline_test

import (
	"context"
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

// The pgx twin of TestTxHandlerBehindDedupeMiddleware: a batched
// NewPgxTxHandler behind the dedupe middleware confirms the middleware's
// claims in its pgx transaction; a failing message is retried alone.
func TestPgxBatchBehindDedupeMiddleware(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 5 * time.Second, BusyDelay: time.Millisecond})
	must(t, err)
	declined := errors.New("card declined")
	var calls sync.Map // message UUID -> *atomic.Int64
	charge := e.charge(nil)
	h, err := pipeline.NewPgxTxHandler(pipeline.PgxTxConfig{DB: e.pool, Store: e.store, BusyDelay: time.Millisecond,
		Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx pgx.Tx, msg *message.Message, out message.Publisher) error {
			n, _ := calls.LoadOrStore(msg.UUID, new(atomic.Int64))
			if n.(*atomic.Int64).Add(1) == 1 && msg.UUID == "pmw-2" {
				return declined
			}
			return charge(ctx, tx, msg, out)
		})
	must(t, err)
	stack := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	handle := func(m *message.Message) error { _, err := stack(m); return err }
	onlyFailed(t, deliverAll(handle, orders(4, "pmw")), "pmw", 2, declined)
	onlyFailed(t, deliverAll(handle, orders(4, "pmw")), "pmw", -1, nil)
	for i := range 4 {
		if n := e.rows(t, fmt.Sprintf("pmw-%d", i)); n != 1 {
			t.Errorf("pmw-%d charged %d times, want once", i, n)
		}
	}
	confirmedAfter(t, e.store, "pmw", 4, 2)
}

// The pgx twin of TestBatchCommitFailureFailsOnlyItsMessage: a deferred
// constraint broken by one message of a pgx batch fails the commit; the
// others commit, only that one fails.
func TestPgxBatchCommitFailureFailsOnlyItsMessage(t *testing.T) {
	t.Parallel()
	e := newPgxEnv(t)
	ledger := testenv.Name(t, "ledger")
	_, err := e.pool.Exec(t.Context(), `CREATE TABLE "`+ledger+`" (ref TEXT NOT NULL, UNIQUE (ref) DEFERRABLE INITIALLY DEFERRED)`)
	must(t, err)
	t.Cleanup(func() { _, _ = e.pool.Exec(context.Background(), `DROP TABLE IF EXISTS "`+ledger+`"`) })
	_, err = e.pool.Exec(t.Context(), `INSERT INTO "`+ledger+`" (ref) VALUES ('taken')`)
	must(t, err)
	h, err := pipeline.NewPgxBatchTxHandler(pipeline.PgxTxConfig{DB: e.pool, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, _ message.Publisher) error {
			for _, m := range msgs {
				if _, err := tx.Exec(ctx, `INSERT INTO "`+ledger+`" (ref) VALUES ($1)`, string(m.Payload)); err != nil {
					return err
				}
			}
			return nil
		})
	must(t, err)
	var msgs []*message.Message
	for i := range 8 {
		ref := fmt.Sprintf("ref-%d", i)
		if i == 5 {
			ref = "taken"
		}
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("pdc-%d", i), []byte(ref)))
	}
	for i, err := range deliverAll(h, msgs) {
		if (i == 5) != (err != nil) {
			t.Fatalf("pdc-%d: %v; want only pdc-5 to fail", i, err)
		}
	}
	var n int
	must(t, e.pool.QueryRow(t.Context(), `SELECT COUNT(*) FROM "`+ledger+`" WHERE ref <> 'taken'`).Scan(&n))
	if n != 7 {
		t.Fatalf("%d of the 7 good messages committed", n)
	}
}
