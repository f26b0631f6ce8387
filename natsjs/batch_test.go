package natsjs_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// HandleBatchTx on JetStream: SubscribersCount puts that many deliveries in
// flight (Subscriber.InFlight), so batches of several form, and each message
// has its effect once.
func TestBatchTx(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := testenv.SQLite(t)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE effects (id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	const n = 64
	var msgs []*message.Message
	for i := range n {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("b-%d", i), []byte("{}")))
	}
	e.publish(t, msgs...)

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(r, pipeline.Config{Publisher: e.publisher(t), Store: store, DisableTracing: true})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		biggest int
	)
	sub := e.subscriber(t, natsjs.Config{Durable: "batch", SubscribersCount: 8})
	if _, err := pipeline.HandleBatchTx(p, "batch", e.topic, sub, pipeline.TxConfig[*sql.Tx]{DB: db.Driver(),
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects (id) VALUES (?)`, m.UUID); err != nil {
					return err
				}
			}
			mu.Lock()
			biggest = max(biggest, len(msgs))
			mu.Unlock()
			return nil
		}); err != nil {
		t.Fatal(err)
	}
	runRouterOnly(t, r)

	deadline := time.Now().Add(20 * time.Second)
	var rows, distinct int
	for time.Now().Before(deadline) {
		if err := db.QueryRow(`SELECT count(*), count(DISTINCT id) FROM effects`).Scan(&rows, &distinct); err != nil {
			t.Fatal(err)
		}
		if distinct == n {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	e.waitSettled(t, "batch", 10*time.Second)
	if err := db.QueryRow(`SELECT count(*), count(DISTINCT id) FROM effects`).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != n || distinct != n {
		t.Errorf("%d effect rows for %d distinct messages, want %d once each", rows, distinct, n)
	}
	mu.Lock()
	defer mu.Unlock()
	if biggest < 2 {
		t.Errorf("largest batch %d: the subscriber put no more than one delivery in flight", biggest)
	}
	t.Logf("largest batch: %d", biggest)
}
