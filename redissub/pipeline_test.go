package redissub_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/redissub"
)

// discard is a publisher for pipelines that park nothing.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// runRouter runs router until done reports true (or 30s pass), then closes
// it.
func runRouter(t *testing.T, router *message.Router, done func() bool) {
	t.Helper()
	ran := make(chan error, 1)
	go func() { ran <- router.Run(context.Background()) }()
	<-router.Running()
	deadline := time.Now().Add(30 * time.Second)
	for !done() {
		if time.Now().After(deadline) {
			_ = router.Close()
			<-ran
			t.Fatal("not done within 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
}

// effects creates a table of effects, one row per message, dropped at the
// test's end.
func effects(t *testing.T, db testenv.DB) string {
	t.Helper()
	table := testenv.Name(t, "fx")
	if _, err := db.ExecContext(t.Context(), `CREATE TABLE "`+table+`" (msg TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`"`) })
	return table
}

func countRows(t *testing.T, db testenv.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(t.Context(), `SELECT count(*) FROM "`+table+`"`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// With pipeline, one redissub subscription fills a batch (Concurrency 1,
// InFlight 16), and every message is charged once.
func TestBatchesFillFromOneSubscription(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	const n = 400
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("{}"))
	}
	publish(t, c, stream, msgs...)
	db := testenv.Postgres(t)
	fx := effects(t, db)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	sub := newSub(t, c, redissub.Config{ConsumerGroup: group, InFlight: 16})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: discard{}, Store: store, DisableTracing: true})
	if err != nil {
		t.Fatal(err)
	}
	var biggest atomic.Int64
	_, err = pipeline.HandleBatchTx(p, "charge", stream, sub, pipeline.TxConfig[*sql.Tx]{DB: db.Driver(), Batch: pipeline.BatchConfig{MaxSize: 16, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			for {
				old := biggest.Load()
				if int64(len(msgs)) <= old || biggest.CompareAndSwap(old, int64(len(msgs))) {
					break
				}
			}
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, `INSERT INTO "`+fx+`" (msg) VALUES ($1)`, m.UUID); err != nil {
					return err
				}
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, router, func() bool { return countRows(t, db, fx) == n })
	if b := biggest.Load(); b < 8 {
		t.Errorf("the largest batch held %d messages; one subscription with 16 in flight should fill batches", b)
	}
	waitPending(t, c, stream, group, 0)
	if got := countRows(t, db, fx); got != n {
		t.Errorf("%d effects, want %d", got, n)
	}
}

// A handler that runs three times MaxIdleTime, with a second consumer of
// the group on its own connection. watermill-redisstream's subscriber lets
// the entry go idle while the handler runs, and the second consumer claims
// it: settle's claim (ClaimTimeout 1s), renewed while the first handler
// runs, defers that delivery until the first confirms, and then acks it as
// a duplicate. One run, one effect. redissub keeps the entry from going idle: it is never
// claimed.
func TestHandlerLongerThanMaxIdleTime(t *testing.T) {
	t.Parallel()
	for _, stock := range []bool{true, false} {
		name := map[bool]string{true: "watermill-redisstream", false: "redissub"}[stock]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			admin := newClient(t)
			stream, group := names(t, admin)
			const idle = time.Second
			db := testenv.Postgres(t)
			fx := effects(t, db)
			table := testenv.DedupeTable(t, db)
			var runs atomic.Int64
			var maxDeliveries atomic.Int64
			// The first consumer's own claim loop would claim the entry back
			// for itself (TestStockNack): it looks once a minute, the second
			// every 100ms.
			consumer := func(claimEvery time.Duration) *message.Router {
				var sub message.Subscriber
				if stock {
					cfg := redissub.SubscriberConfig(newClient(t), group)
					cfg.MaxIdleTime, cfg.ClaimInterval = idle, claimEvery
					sub = stockSub(t, cfg)
				} else {
					sub = newSub(t, newClient(t), redissub.Config{ConsumerGroup: group, MaxIdleTime: idle, ClaimInterval: claimEvery})
				}
				store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
				if err != nil {
					t.Fatal(err)
				}
				router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				p, err := pipeline.New(router, pipeline.Config{Publisher: discard{}, Store: store, DisableTracing: true, ClaimTimeout: time.Second})
				if err != nil {
					t.Fatal(err)
				}
				// A plain handler: the effect is written apart from the claim,
				// which alone keeps it once.
				_, err = p.Handle("charge", stream, sub, func(m *message.Message) error {
					runs.Add(1)
					time.Sleep(3 * idle)
					_, err := db.ExecContext(m.Context(), `INSERT INTO "`+fx+`" (msg) VALUES ($1)`, m.UUID)
					return err
				})
				if err != nil {
					t.Fatal(err)
				}
				return router
			}
			publish(t, admin, stream, message.NewMessage(watermill.NewUUID(), []byte("{}")))
			first, second := consumer(time.Minute), consumer(100*time.Millisecond)
			// The first consumer takes the message; then the second starts.
			ran := make(chan error, 1)
			go func() { ran <- first.Run(context.Background()) }()
			<-first.Running()
			for deadline := time.Now().Add(10 * time.Second); runs.Load() == 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the first consumer did not run the handler")
				}
			}
			runRouter(t, second, func() bool {
				for _, p := range pendingOf(t, admin, stream, group) {
					maxDeliveries.Store(max(maxDeliveries.Load(), p.RetryCount))
				}
				return countRows(t, db, fx) >= 1 && len(pendingOf(t, admin, stream, group)) == 0
			})
			if err := first.Close(); err != nil {
				t.Fatal(err)
			}
			if err := <-ran; err != nil {
				t.Fatal(err)
			}
			if r := runs.Load(); r != 1 {
				t.Errorf("handler ran %d times, want 1", r)
			}
			if got := countRows(t, db, fx); got != 1 {
				t.Errorf("%d effects, want 1", got)
			}
			d := maxDeliveries.Load()
			t.Logf("%s: the entry was delivered %d time(s)", name, d)
			if stock && d < 2 {
				t.Errorf("the entry was delivered %d time(s): the second consumer never claimed it, the test proves nothing", d)
			}
			if !stock && d != 1 {
				t.Errorf("the entry was delivered %d times, want 1: the heartbeat should keep it", d)
			}
		})
	}
}
