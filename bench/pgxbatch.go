package main

import (
	"context"
	"database/sql"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// pgxTxBatch is the batched workload of the pgx section: g deliveries in
// flight share one transaction (BatchConfig.MaxSize g), whose keys are
// claimed confirmed in one statement and whose effects are inserted in one
// statement; one commit for the batch. settle's batch handler on pgx
// and on database/sql (NewBatchTxHandler, on sqldb.Pgx and sqldb.Std) beside
// the raw pgx floor: the same two statements in a transaction, batched by
// the smallest batcher that does the same gathering.
const pgxTxBatch = "tx-batch"

// batchOp returns the op of one side of the tx-batch workload at g
// goroutines.
func (b *pgxBench) batchOp(ctx context.Context, side string, g int) (func(ctx context.Context, key string) error, string, error) {
	sqlStore, ps, claims, effects, err := b.cellTables(ctx)
	if err != nil {
		return nil, "", err
	}
	insertAll := "INSERT INTO " + effects + " (msg) SELECT unnest($1::text[])"
	ids := func(msgs []*message.Message) []string {
		s := make([]string, len(msgs))
		for i, m := range msgs {
			s[i] = m.UUID
		}
		return s
	}
	batch := pipeline.BatchConfig{MaxSize: g}
	switch side {
	case pgxFloor:
		rb := &rawBatcher{max: g, wait: batchWait, run: func(ctx context.Context, keys []string) error {
			return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				if _, err := rawClaimAll(ctx, tx, `"`+claims+`"`, keys); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, insertAll, keys)
				return err
			})
		}}
		return rb.do, effects, nil
	case pgxNat:
		h, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(b.pool), Store: ps, Batch: batch},
			func(ctx context.Context, tx pgx.Tx, msgs []*message.Message, _ message.Publisher) error {
				_, err := tx.Exec(ctx, insertAll, ids(msgs))
				return err
			})
		if err != nil {
			return nil, "", err
		}
		return msgOp(h), effects, nil
	default:
		h, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(b.db, sqldb.Postgres), Store: sqlStore, Batch: batch},
			func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
				_, err := tx.ExecContext(ctx, insertAll, ids(msgs))
				return err
			})
		if err != nil {
			return nil, "", err
		}
		return msgOp(h), effects, nil
	}
}

// rawBatcher gathers concurrent calls into batches of up to max keys, as
// settle's batcher does (the first caller leads, waits up to wait for the
// batch to fill, runs it and answers the others), without any of its
// settlement: the floor of group commit.
type rawBatcher struct {
	max  int
	wait time.Duration
	run  func(ctx context.Context, keys []string) error

	mu   sync.Mutex
	open *rawBatch
}

type rawBatch struct {
	keys []string
	full chan struct{} // closed when keys reaches max
	done chan struct{} // closed when err is set
	err  error
}

func (r *rawBatcher) do(ctx context.Context, key string) error {
	r.mu.Lock()
	bt := r.open
	leader := bt == nil
	if leader {
		bt = &rawBatch{full: make(chan struct{}), done: make(chan struct{})}
		r.open = bt
	}
	bt.keys = append(bt.keys, key)
	if len(bt.keys) >= r.max {
		r.open = nil
		close(bt.full)
	}
	r.mu.Unlock()
	if leader {
		t := time.NewTimer(r.wait)
		select {
		case <-bt.full:
		case <-t.C:
		}
		t.Stop()
		r.mu.Lock()
		if r.open == bt {
			r.open = nil
		}
		keys := bt.keys
		r.mu.Unlock()
		bt.err = r.run(context.WithoutCancel(ctx), keys)
		close(bt.done)
	}
	<-bt.done
	return bt.err
}
