package pipeline_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

type OrderPlaced struct {
	ID    string `json:"id"`
	Cents int    `json:"cents"`
}

// A typed handler behind the whole stack: a duplicate is absorbed, and a
// payload that is not an OrderPlaced goes to the poison topic.
func Example() {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})

	p, err := pipeline.New(router, pipeline.Config{
		Publisher:      pubsub,
		Store:          dedupe.NewMemoryStore(),
		DisableTracing: true,
	})
	if err != nil {
		panic(err)
	}
	charged := make(chan string, 10)
	_, err = p.Handle("charge", "orders", pubsub, pipeline.Typed(nil, func(ctx context.Context, m pipeline.Message[OrderPlaced]) error {
		charged <- fmt.Sprintf("charged %s: %d cents", m.Body.ID, m.Body.Cents)
		return nil
	}))
	if err != nil {
		panic(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	defer router.Close()
	<-router.Running()

	msg, _ := pipeline.NewMessage("m-1", nil, OrderPlaced{ID: "A-17", Cents: 1999})
	_ = pubsub.Publish("orders", msg, msg.Copy()) // delivered twice
	_ = pubsub.Publish("orders", message.NewMessage("m-2", []byte(`{"id": 17}`)))

	poisoned, _ := pubsub.Subscribe(context.Background(), "orders.poison")
	fmt.Println(<-charged)
	p2 := <-poisoned
	p2.Ack()
	fmt.Println("poisoned:", p2.UUID)
	// Output:
	// charged A-17: 1999 cents
	// poisoned: m-2
}

// A transactional handler, on database/sql or on pgx: the driver is named
// once, where the database is opened, and the handler's function gets that
// driver's transaction. It needs a PostgreSQL server, so it is compiled but
// not run.
func ExampleHandleTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/shop")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	db := sqldb.Pgx(pool) // on database/sql: sqldb.Std(sqlDB, sqldb.Postgres), and *sql.Tx below
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{})
	if err != nil {
		panic(err)
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		panic(err)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	p, err := pipeline.New(router, pipeline.Config{Publisher: pubsub, Store: store})
	if err != nil {
		panic(err)
	}
	_, err = pipeline.HandleTx(p, "charge", "orders", pubsub, pipeline.TxConfig[pgx.Tx]{DB: db, Outbox: ob},
		pipeline.TypedTx(nil, func(ctx context.Context, tx pgx.Tx, m pipeline.Message[OrderPlaced], out message.Publisher) error {
			if _, err := tx.Exec(ctx, "INSERT INTO charges (order_id, cents) VALUES ($1, $2)", m.Body.ID, m.Body.Cents); err != nil {
				return err
			}
			// Written in tx: the receipt, the charge and the key commit together.
			return out.Publish("receipts", message.NewMessage("receipt-"+m.UUID, nil))
		}))
	if err != nil {
		panic(err)
	}
}
