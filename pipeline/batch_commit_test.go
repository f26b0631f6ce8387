package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/pipeline"
)

// A batch in which one message's write breaks a deferred constraint: the
// violation surfaces at COMMIT, not at the handler's statement. The others
// must commit and only that message fail, as with any failing message and
// as in the per-message mode. Before, the commit's error went to every
// message of the batch, and every redelivery of the same batch failed whole
// again, so good messages spent their attempts and were dead-lettered
// beside the bad one.
func TestBatchCommitFailureFailsOnlyItsMessage(t *testing.T) {
	t.Parallel()
	onPostgres(t, batchCommitFailureFailsOnlyItsMessage[*sql.Tx], batchCommitFailureFailsOnlyItsMessage[pgx.Tx])
}

func batchCommitFailureFailsOnlyItsMessage[TTx any](t *testing.T, d db[TTx]) {
	db := d.sql
	e := newTxEnv(t, d)
	ledger := "ledger_" + e.charges[len(e.charges)-8:]
	_, err := db.ExecContext(t.Context(), "CREATE TABLE "+ledger+
		" (ref TEXT NOT NULL, CONSTRAINT "+ledger+"_u UNIQUE (ref) DEFERRABLE INITIALLY DEFERRED)")
	must(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+ledger) })
	// A reference that is taken already: the message carrying it cannot commit.
	_, err = db.ExecContext(t.Context(), "INSERT INTO "+ledger+" (ref) VALUES ('taken')")
	must(t, err)

	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 50 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
			_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+ledger+" (ref) VALUES ($1)", string(msg.Payload))
			return err
		})
	must(t, err)
	batch := func() []*message.Message {
		var msgs []*message.Message
		for i := range 8 {
			ref := fmt.Sprintf("ref-%d", i)
			if i == 3 {
				ref = "taken"
			}
			msgs = append(msgs, message.NewMessage(fmt.Sprintf("dc-%d", i), []byte(ref)))
		}
		return msgs
	}
	// The broker delivers the same eight again after each failure, three
	// times (MaxAttempts 3).
	var failedGood int
	for attempt := 1; attempt <= 3; attempt++ {
		errs := deliverAll(h, batch())
		failedGood = 0
		for i, err := range errs {
			if i != 3 && err != nil {
				failedGood++
				if attempt == 1 {
					t.Logf("dc-%d (attempt %d): %v", i, attempt, err)
				}
			}
		}
	}
	var n int
	must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+ledger+" WHERE ref <> 'taken'").Scan(&n))
	if n != 7 || failedGood != 0 {
		t.Fatalf("after 3 deliveries: %d of 7 good messages committed, %d good messages still failing; "+
			"want the 7 committed and only dc-3 failing", n, failedGood)
	}
}
