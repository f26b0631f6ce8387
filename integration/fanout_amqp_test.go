package integration_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// Two handlers of one message on RabbitMQ: an exchange with two queues bound
// to it, one per handler (watermill-amqp's pub/sub config), one dedupe store
// on PostgreSQL shared by both. Every message is published twice, as a
// producer retrying after a lost confirm would. Each handler must do its work
// exactly once per message: "charge" and "email" are two effects, not one.
// The router is built three ways: by pipeline, by hand with the dedupe
// middleware on each handler (as the README shows), and by hand with it on
// the router.
func TestTwoHandlersOfOneMessageOnRabbitMQ(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"pipeline", "per-handler", "router-wide"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			url := testenv.AMQPURL(t)
			db := testenv.Postgres(t)
			effects := testenv.Name(t, "fx")
			_, err := db.ExecContext(t.Context(), `CREATE TABLE "`+effects+`" (handler text NOT NULL, message_uuid text NOT NULL)`)
			saMust(t, err)
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+effects+`"`) })
			store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
			saMust(t, err)

			exchange := testenv.Name(t, "ex")
			t.Cleanup(func() { deleteExchange(t, url, exchange) })
			subscriber := func(handler string) message.Subscriber {
				cfg := amqp.NewDurablePubSubConfig(url, amqp.GenerateQueueNameTopicNameWithSuffix(handler))
				sub, err := amqp.NewSubscriber(cfg, testenv.AMQPLogger(t, nil))
				saMust(t, err)
				t.Cleanup(func() { _ = sub.Close() })
				t.Cleanup(func() { deleteQueue(t, url, exchange+"_"+handler) })
				// Declare and bind the queue now, so that nothing published
				// before the router runs is lost.
				saMust(t, sub.SubscribeInitialize(exchange))
				return sub
			}
			pubCfg := amqp.NewDurablePubSubConfig(url, nil)
			pubCfg.Publish.ConfirmDelivery = true
			pub, err := amqp.NewPublisher(pubCfg, testenv.AMQPLogger(t, nil))
			saMust(t, err)
			t.Cleanup(func() { _ = pub.Close() })

			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: dedupeWait}, watermill.NopLogger{})
			saMust(t, err)
			handler := func(name string) message.NoPublishHandlerFunc {
				return func(msg *message.Message) error {
					_, err := db.ExecContext(msg.Context(), `INSERT INTO "`+effects+`" (handler, message_uuid) VALUES ($1, $2)`, name, msg.UUID)
					return err
				}
			}
			dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
			saMust(t, err)
			switch how {
			case "pipeline":
				p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, DisableTracing: true})
				saMust(t, err)
				for _, name := range []string{"charge", "email"} {
					_, err := p.Handle(name, exchange, subscriber(name), handler(name))
					saMust(t, err)
				}
			case "per-handler":
				for _, name := range []string{"charge", "email"} {
					router.AddConsumerHandler(name, exchange, subscriber(name), handler(name)).AddMiddleware(dd)
				}
			case "router-wide":
				router.AddMiddleware(dd)
				for _, name := range []string{"charge", "email"} {
					router.AddConsumerHandler(name, exchange, subscriber(name), handler(name))
				}
			}

			const n = 25
			for i := range n {
				uuid := fmt.Sprintf("%s-%d", how, i)
				for range 2 {
					saMust(t, pub.Publish(exchange, message.NewMessage(uuid, []byte(`{}`))))
				}
			}
			stop := runRouter(t, router, dedupeWait)
			count := func() (rows, distinct int) {
				err := db.QueryRowContext(t.Context(), `SELECT COUNT(*), COUNT(DISTINCT (handler, message_uuid)) FROM "`+effects+`"`).Scan(&rows, &distinct)
				saMust(t, err)
				return rows, distinct
			}
			deadline := time.Now().Add(dedupeWait)
			for _, d := count(); d < 2*n; _, d = count() {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d (handler, message) effects within %v", d, 2*n, dedupeWait)
				}
				time.Sleep(20 * time.Millisecond)
			}
			time.Sleep(300 * time.Millisecond) // the second copies settle
			stop()
			if rows, distinct := count(); rows != 2*n || distinct != 2*n {
				t.Fatalf("%d effects (%d distinct) for %d messages and two handlers; want %d, each once", rows, distinct, n, 2*n)
			}
		})
	}
}

func deleteExchange(t *testing.T, url, exchange string) {
	withChannel(t, url, func(ch *amqp091.Channel) error { return ch.ExchangeDelete(exchange, false, false) })
}

func deleteQueue(t *testing.T, url, queue string) {
	withChannel(t, url, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDelete(queue, false, false, false)
		return err
	})
}

// withChannel runs fn on a channel of a new connection to url, reporting
// failures on t.
func withChannel(t *testing.T, url string, fn func(*amqp091.Channel) error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Errorf("rabbitmq: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Errorf("rabbitmq: %v", err)
		return
	}
	defer ch.Close()
	if err := fn(ch); err != nil {
		t.Errorf("rabbitmq: %v", err)
	}
}
