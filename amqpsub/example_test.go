package amqpsub_test

import (
	"context"
	"database/sql"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// A batch handler fed by one RabbitMQ subscription with sixteen deliveries
// in flight: batches of up to sixteen payments commit together. It needs a
// running broker and database, so the example is compiled, not run.
func ExampleNewSubscriber() {
	logger := watermill.NewStdLogger(false, false)
	marshaler, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		log.Fatal(err)
	}
	cfg := amqp.NewDurableQueueConfig(os.Getenv("AMQP_URL"))
	cfg.Marshaler = marshaler

	// Up to 16 deliveries in the router at once; the prefetch of 1 that
	// NewDurableQueueConfig sets is raised to 64.
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: cfg, InFlight: 16}, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	// The pipeline acks a delivery once its dead-letter copy or its output
	// is published: amqpsub's publisher returns only once RabbitMQ has
	// routed the message to a queue and confirmed it.
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: cfg}, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()

	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.Postgres), dedupe.SQLConfig{})
	if err != nil {
		log.Fatal(err)
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	// Concurrency 1: one subscription, which has 16 deliveries in flight.
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, Concurrency: 1})
	if err != nil {
		log.Fatal(err)
	}
	_, err = pipeline.HandleBatchTx(p, "ledger", "payments", sub,
		pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(db, sqldb.Postgres), Batch: pipeline.BatchConfig{MaxSize: 16}},
		func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, "INSERT INTO ledger (payment) VALUES ($1)", m.UUID); err != nil {
					return err
				}
			}
			return nil
		})
	if err != nil {
		log.Fatal(err)
	}
	if err := router.Run(context.Background()); err != nil {
		log.Fatal(err)
	}
}
