package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// Two batched handlers of one topic (a group-commit HandleTx and a
// HandleBatchTx, each on its own queue), their router closed three times
// while batches are open and started again: every order is done exactly once
// by each handler, with one outbox row per publish, nothing parked.
func TestBatchRouterCloseMidBatch(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases()[1:3] {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			e := newTxEnv(t, stdOf(db))
			effects := effectTable(t, e, &db, nil, "h VARCHAR(16) NOT NULL, id VARCHAR(64) NOT NULL")
			a := newBatchAMQP(t, "close")
			m, err := amqpmarshal.New(amqpmarshal.Config{})
			must(t, err)
			cfg := amqp.NewDurableQueueConfig(testenv.AMQPURL(t))
			cfg.Marshaler = m
			cfg.Consume.Qos.PrefetchCount = 2
			ins := func(ctx context.Context, tx *sql.Tx, h, id string) error {
				_, err := tx.ExecContext(ctx, "INSERT INTO "+effects+" (h, id) VALUES ("+e.db.ph(1)+", "+e.db.ph(2)+")", h, id)
				return err
			}
			pubsub := func(h string) amqp.Config {
				c := amqp.NewDurablePubSubConfig(testenv.AMQPURL(t), amqp.GenerateQueueNameTopicNameWithSuffix(h))
				c.Marshaler = m
				c.Consume.Qos.PrefetchCount = 2
				return c
			}
			srcPub, err := amqp.NewPublisher(pubsub("one"), testenv.AMQPLogger(t, nil))
			must(t, err)
			t.Cleanup(func() { _ = srcPub.Close() })
			t.Cleanup(func() {
				for _, q := range []string{a.src + "_one", a.src + "_two"} {
					_, _ = a.ch.QueueDelete(q, false, false, false)
				}
				_ = a.ch.ExchangeDelete(a.src, false, false)
			})
			start := func() func() {
				sub, err := amqp.NewSubscriber(pubsub("one"), testenv.AMQPLogger(t, nil))
				must(t, err)
				sub2, err := amqp.NewSubscriber(pubsub("two"), testenv.AMQPLogger(t, nil))
				must(t, err)
				router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
				must(t, err)
				p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Store: e.store, Concurrency: 4,
					Retry: fastRetry(), DisableTracing: true, BusyDelay: 20 * time.Millisecond})
				must(t, err)
				_, err = pipeline.HandleTx(p, "one", a.src, sub, pipeline.TxConfig[*sql.Tx]{DB: std(db), Outbox: e.ob,
					Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 5 * time.Millisecond}},
					func(ctx context.Context, tx *sql.Tx, msg *message.Message, out message.Publisher) error {
						if err := ins(ctx, tx, "one", msg.UUID); err != nil {
							return err
						}
						time.Sleep(5 * time.Millisecond)
						return out.Publish("receipts", message.NewMessage("r1-"+msg.UUID, msg.Payload))
					})
				must(t, err)
				// A second handler of the same topic, on its own queue: a
				// batch handler. Each does each order once.
				_, err = pipeline.HandleBatchTx(p, "two", a.src, sub2, pipeline.TxConfig[*sql.Tx]{DB: std(db), Outbox: e.ob,
					Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 5 * time.Millisecond}},
					func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, out message.Publisher) error {
						for _, msg := range msgs {
							if err := ins(ctx, tx, "two", msg.UUID); err != nil {
								return err
							}
							if err := out.Publish("receipts", message.NewMessage("r2-"+msg.UUID, msg.Payload)); err != nil {
								return err
							}
						}
						time.Sleep(10 * time.Millisecond)
						return nil
					})
				must(t, err)
				done := make(chan error, 1)
				go func() { done <- router.Run(context.Background()) }()
				<-router.Running()
				var once sync.Once
				stop := func() {
					once.Do(func() {
						must(t, router.Close())
						must(t, <-done)
						must(t, sub.Close())
						must(t, sub2.Close())
					})
				}
				t.Cleanup(stop)
				return stop
			}
			const n = 200
			stop := start() // declares the queues
			for i := range n {
				id := fmt.Sprintf("rc-%d", i)
				must(t, srcPub.Publish(a.src, message.NewMessage(id, []byte(id))))
			}
			for range 3 {
				time.Sleep(150 * time.Millisecond)
				stop()
				stop = start()
			}
			count := func() (total, distinct int) {
				must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*), COUNT(DISTINCT id) FROM "+effects).Scan(&total, &distinct))
				return
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				total, c := count()
				if c >= n && total >= 2*n || time.Now().After(deadline) {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(300 * time.Millisecond)
			total, distinct := count()
			var rows int
			must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+quote(db, e.ob.Table())).Scan(&rows))
			dl, ps := a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison")
			var dupSame int
			must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM (SELECT h, id FROM "+effects+" GROUP BY h, id HAVING COUNT(*) > 1) d").Scan(&dupSame))
			if total != 2*n || distinct != n || rows != 2*n || dupSame != 0 || dl != 0 || ps != 0 {
				t.Fatalf("effects=%d distinct=%d outbox rows=%d dead-lettered=%d poisoned=%d; want %d orders, each once per handler, none parked", total, distinct, rows, dl, ps, n)
			}
		})
	}
}
