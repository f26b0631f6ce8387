package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// batchAMQP is a durable-queue publisher and subscriber on RabbitMQ, with
// the source queue and its parking queues declared (and deleted at the end).
type batchAMQP struct {
	pub *amqp.Publisher
	sub *amqp.Subscriber
	ch  *amqp091.Channel
	src string
	cfg amqp.Config // of pub and sub, for a subscriber of another kind on src
}

func newBatchAMQP(t *testing.T, prefix string) *batchAMQP {
	t.Helper()
	u := testenv.AMQPURL(t)
	src := testenv.Name(t, prefix)
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	must(t, err)
	cfg := amqp.NewDurableQueueConfig(u)
	cfg.Marshaler = m
	cfg.Consume.Qos.PrefetchCount = 2
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	conn, err := amqp091.Dial(u)
	must(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	must(t, err)
	for _, q := range []string{src, src + ".poison", src + ".dead_letter"} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		must(t, err)
		t.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	}
	return &batchAMQP{pub: pub, sub: sub, ch: ch, src: src, cfg: cfg}
}

func (a *batchAMQP) depth(t *testing.T, q string) int {
	t.Helper()
	st, err := a.ch.QueueDeclarePassive(q, true, false, false, false, nil)
	must(t, err)
	return st.Messages
}

// effectTable creates a table of effects on db with the given columns,
// dropped at the end of the test through drop (db itself when nil).
func effectTable[TTx any](t *testing.T, e *txEnv[TTx], db, drop *testenv.DB, columns string) string {
	t.Helper()
	if drop == nil {
		drop = db
	}
	name := "eff_" + e.charges[len(e.charges)-8:]
	_, err := db.ExecContext(t.Context(), "CREATE TABLE "+name+" ("+columns+")")
	must(t, err)
	t.Cleanup(func() { _, _ = drop.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+name) })
	return name
}

// runBatchedCharge runs a router with a batched HandleTx on a's queue that
// writes one row of effects per message (after pause) and publishes a
// receipt through the outbox; inserts that fail are counted in failures.
func runBatchedCharge(t *testing.T, a *batchAMQP, e *txEnv[*sql.Tx], db testenv.DB, effects string, pause time.Duration, failures *atomic.Int64) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Store: e.store, Concurrency: 4,
		Retry: fastRetry(), DisableTracing: true, BusyDelay: 20 * time.Millisecond})
	must(t, err)
	_, err = pipeline.HandleTx(p, "charge", a.src, a.sub, pipeline.TxConfig[*sql.Tx]{DB: std(db), Outbox: e.ob,
		Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 5 * time.Millisecond}},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
			if _, err := tx.ExecContext(ctx, "INSERT INTO "+effects+" (id) VALUES ("+e.db.ph(1)+")", msg.UUID); err != nil {
				failures.Add(1)
				return err
			}
			time.Sleep(pause) // widens the window for the fault
			return out.Publish("receipts", message.NewMessage("receipt-"+msg.UUID, msg.Payload))
		})
	must(t, err)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
	})
}

// publishOrders publishes n orders prefix-0 … to a's queue.
func (a *batchAMQP) publishOrders(t *testing.T, prefix string, n int) {
	t.Helper()
	for i := range n {
		id := fmt.Sprintf("%s-%d", prefix, i)
		must(t, a.pub.Publish(a.src, message.NewMessage(id, []byte(id))))
	}
}

// checkEachOnce waits until n orders are charged or parked, then requires
// n effects, each once, n outbox rows, and nothing parked.
func (a *batchAMQP) checkEachOnce(t *testing.T, db testenv.DB, e *txEnv[*sql.Tx], effects string, n int) {
	t.Helper()
	count := func() (total, distinct int) {
		must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*), COUNT(DISTINCT id) FROM "+effects).Scan(&total, &distinct))
		return
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, c := count()
		if c+a.depth(t, a.src+".dead_letter")+a.depth(t, a.src+".poison") >= n || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // anything doubled arrives by then
	total, distinct := count()
	var rows int
	must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+quote(db, e.ob.Table())).Scan(&rows))
	dl, ps := a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison")
	if total != n || distinct != n || rows != n || dl != 0 || ps != 0 {
		t.Fatalf("effects=%d distinct=%d outbox rows=%d dead-lettered=%d poisoned=%d; want %d effects, each once, %d rows, none parked",
			total, distinct, rows, dl, ps, n, n)
	}
}

// openPostgresAs opens SETTLE_POSTGRES_URL with an application_name of its
// own, so that the test can terminate its own connections and no other.
func openPostgresAs(t *testing.T, app string) testenv.DB {
	t.Helper()
	u, err := url.Parse(testenv.Require(t, testenv.PostgresURLEnv))
	must(t, err)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	db, dialect, err := sqlurl.Open(u.String())
	must(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return testenv.DB{DB: db, Dialect: dialect}
}

// The database connections of a batched HandleTx are killed several times
// while RabbitMQ feeds it: every order must still be charged exactly once,
// with one outbox row, and no order may be dead-lettered for the outage.
func TestBatchSurvivesKilledConnections(t *testing.T) {
	t.Parallel()
	app := testenv.Name(t, "app")
	db := openPostgresAs(t, app)
	admin := testenv.Postgres(t)
	e := newTxEnv(t, stdOf(db))
	effects := effectTable(t, e, &db, &admin, "id TEXT NOT NULL")
	a := newBatchAMQP(t, "outage")
	var failures atomic.Int64
	runBatchedCharge(t, a, e, db, effects, 2*time.Millisecond, &failures)
	const n = 400
	a.publishOrders(t, "ko", n)
	var kills int64
	for range 30 {
		time.Sleep(40 * time.Millisecond)
		var k int64
		must(t, admin.QueryRowContext(t.Context(),
			"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&k))
		kills += k
	}
	t.Logf("killed %d connections, %d handler statements failed", kills, failures.Load())
	a.checkEachOnce(t, admin, e, effects, n)
}

// The claims table disappears (renamed) for a second while a batched
// HandleTx runs on RabbitMQ, then comes back: every order is charged once,
// and none is dead-lettered for the store's outage.
func TestBatchSurvivesClaimsTableOutage(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			e := newTxEnv(t, stdOf(db))
			effects := effectTable(t, e, &db, nil, "id VARCHAR(64) NOT NULL")
			a := newBatchAMQP(t, "claimsout")
			runBatchedCharge(t, a, e, db, effects, time.Millisecond, new(atomic.Int64))
			const n = 300
			a.publishOrders(t, "co", n)
			time.Sleep(20 * time.Millisecond)
			// The claims table goes away for a second, then comes back.
			renameTo := func(from, to string) {
				q := "ALTER TABLE " + quote(db, from) + " RENAME TO " + quote(db, to)
				if db.Dialect == sqldb.MySQL {
					q = "RENAME TABLE " + quote(db, from) + " TO " + quote(db, to)
				}
				_, err := db.ExecContext(t.Context(), q)
				must(t, err)
			}
			renameTo(e.claims, e.claims+"_x")
			time.Sleep(time.Second)
			{
				var c int
				must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+effects).Scan(&c))
				t.Logf("%d of %d charged when the claims table comes back", c, n)
			}
			renameTo(e.claims+"_x", e.claims)
			a.checkEachOnce(t, db, e, effects, n)
		})
	}
}
