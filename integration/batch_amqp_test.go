package integration_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

type batchOrder struct {
	Cents int `json:"cents"`
}

// Batched settlement on RabbitMQ with PostgreSQL and MariaDB: eight
// competing subscriptions feed group-committed transactions, through a
// per-message handler (TxConfig.Batch) and through a batch handler
// (HandleBatchTx). Every order is published twice; one payload is not JSON,
// one order is always refused. Each good order must leave exactly one
// effect row, the bad payload must be parked on the poison queue, the
// refused order on the dead-letter queue after its attempts, and batches of
// more than one message must really have formed.
func TestBatchedSettlementOnRabbitMQ(t *testing.T) {
	t.Parallel()
	for _, dbName := range []string{"postgres", "mysql"} {
		for _, kind := range []string{"per-message", "batch-handler"} {
			t.Run(dbName+"/"+kind, func(t *testing.T) {
				t.Parallel()
				runBatchedOnRabbitMQ(t, dbName, kind)
			})
		}
	}
}

func runBatchedOnRabbitMQ(t *testing.T, dbName, kind string) {
	url := testenv.AMQPURL(t)
	db := testenv.Postgres
	if dbName == "mysql" {
		db = testenv.MySQL
	}
	d := db(t)
	ph := func(i int) string {
		if d.Dialect == sqldb.Postgres {
			return fmt.Sprintf("$%d", i)
		}
		return "?"
	}
	effects := testenv.Name(t, "fx")
	_, err := d.ExecContext(t.Context(), "CREATE TABLE "+effects+" (msg VARCHAR(64) NOT NULL)")
	saMust(t, err)
	t.Cleanup(func() { _, _ = d.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+effects) })
	store, err := dedupe.NewSQLStore(d.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, d)})
	saMust(t, err)

	src := testenv.Name(t, "src")
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	saMust(t, err)
	cfg := amqp.NewDurableQueueConfig(url)
	cfg.Marshaler = m
	cfg.Consume.Qos.PrefetchCount = 2
	cfg.Publish.ConfirmDelivery = true
	conn, err := amqp091.Dial(url)
	saMust(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	saMust(t, err)
	for _, q := range []string{src, src + ".poison", src + ".dead_letter"} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		saMust(t, err)
		t.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	}
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: dedupeWait}, watermill.NopLogger{})
	saMust(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, Concurrency: 8,
		Retry: saFastRetry(3, 0), DisableTracing: true})
	saMust(t, err)
	txc := pipeline.TxConfig[*sql.Tx]{DB: d.Driver(), Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 5 * time.Millisecond}}
	var biggest atomic.Int64 // the largest batch seen
	seen := func(n int) {
		for {
			old := biggest.Load()
			if int64(n) <= old || biggest.CompareAndSwap(old, int64(n)) {
				return
			}
		}
	}
	insert := "INSERT INTO " + effects + " (msg) VALUES (" + ph(1) + ")"
	refuse := func(uuid string) error {
		if uuid == "refused" {
			return fmt.Errorf("card declined for %s", uuid)
		}
		return nil
	}
	switch kind {
	case "per-message":
		var inTx txCalls
		_, err = pipeline.HandleTx(p, "charge", src, sub, txc, pipeline.TypedTx(nil, func(ctx context.Context, tx *sql.Tx, o pipeline.Message[batchOrder], _ message.Publisher) error {
			seen(inTx.add(tx))
			if err := refuse(o.UUID); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, insert, o.UUID)
			return err
		}))
	case "batch-handler":
		_, err = pipeline.HandleBatchTx(p, "charge", src, sub, txc, func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			seen(len(msgs))
			for i, msg := range msgs {
				o, err := pipeline.Decode[batchOrder](nil, msg)
				if err != nil {
					return pipeline.MessageFailed(i, err) // the payload that is not JSON: poisoned alone
				}
				if err := refuse(o.UUID); err != nil {
					return pipeline.MessageFailed(i, err)
				}
				if _, err := tx.ExecContext(ctx, insert, o.UUID); err != nil {
					return err
				}
			}
			return nil
		})
	}
	saMust(t, err)

	const n = 200
	publish := func(uuid string, payload string) {
		saMust(t, pub.Publish(src, message.NewMessage(uuid, []byte(payload))))
	}
	for i := range n {
		publish(fmt.Sprintf("order-%d", i), `{"cents": 100}`)
	}
	publish("bad-json", `{"cents":`)
	publish("refused", `{"cents": 1}`)
	for i := range n { // every order again: duplicates across batches
		publish(fmt.Sprintf("order-%d", i), `{"cents": 100}`)
	}
	stop := runRouter(t, router, dedupeWait)

	count := func() (rows, distinct int) {
		saMust(t, d.QueryRowContext(t.Context(), "SELECT COUNT(*), COUNT(DISTINCT msg) FROM "+effects).Scan(&rows, &distinct))
		return rows, distinct
	}
	deadline := time.Now().Add(dedupeWait)
	for {
		_, distinct := count()
		parked := 0
		for _, q := range []string{src + ".poison", src + ".dead_letter"} {
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			saMust(t, err)
			parked += st.Messages
		}
		st, err := ch.QueueDeclarePassive(src, true, false, false, false, nil)
		saMust(t, err)
		if distinct == n && parked == 2 && st.Messages == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %d of %d orders done, %d of 2 parked, %d waiting", dedupeWait, distinct, n, parked, st.Messages)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the last duplicates settle
	stop()
	if rows, distinct := count(); rows != n || distinct != n {
		t.Fatalf("%d effect rows (%d distinct) for %d orders delivered twice; want %d, each once", rows, distinct, n, n)
	}
	poisoned := saDrain(t, ch, m, src+".poison")
	dead := saDrain(t, ch, m, src+".dead_letter")
	if len(poisoned) != 1 || poisoned[0].UUID != "bad-json" || len(dead) != 1 || dead[0].UUID != "refused" {
		t.Fatalf("poison %v, dead letters %v; want bad-json and refused", uuids(poisoned), uuids(dead))
	}
	if left := saQueueAfterConsumersLeft(t, ch, src, nil); left != 0 {
		t.Fatalf("%d messages left in the source queue", left)
	}
	if b := biggest.Load(); b < 2 {
		t.Fatalf("the largest batch held %d message(s); batches did not form", b)
	}
}

func uuids(msgs []*message.Message) []string {
	var s []string
	for _, m := range msgs {
		s = append(s, m.UUID)
	}
	return s
}

// txCalls counts the calls made in each transaction.
type txCalls struct {
	mu  sync.Mutex
	per map[*sql.Tx]int
}

func (s *txCalls) add(tx *sql.Tx) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.per == nil {
		s.per = map[*sql.Tx]int{}
	}
	s.per[tx]++
	return s.per[tx]
}
