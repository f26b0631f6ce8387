package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "modernc.org/sqlite"

	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// A message published in a transaction is forwarded only if the
// transaction commits.
func Example() {
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()

	ob, err := outbox.New(sqldb.Std(db, sqldb.SQLite), outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := ob.InitSchema(ctx); err != nil { // normally in your migrations
		panic(err)
	}

	publishIn := func(commit bool, uuid string) {
		tx, _ := db.BeginTx(ctx, nil)
		defer tx.Rollback()
		pub, _ := ob.TxPublisher(tx)
		if err := pub.Publish("orders.placed", message.NewMessage(uuid, []byte(`{"id":"A-17"}`))); err != nil {
			panic(err)
		}
		if commit {
			_ = tx.Commit()
		}
	}
	publishIn(false, "rolled-back")
	publishIn(true, "committed")

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer broker.Close()
	n, err := ob.Forward(ctx, broker, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	fmt.Println("forwarded:", n, err)

	msgs, _ := broker.Subscribe(ctx, "orders.placed")
	m := <-msgs
	m.Ack()
	fmt.Println(m.UUID, string(m.Payload))
	// Output:
	// forwarded: 1 <nil>
	// committed {"id":"A-17"}
}

// On PostgreSQL, with NotifyAfterCommit the writers' INSERTs carry no
// pg_notify; a Notifier sends the wake-up for relays in other processes
// after each commit that Notify announces, coalescing those that come
// together.
func ExampleOutbox_NewNotifier() {
	db, err := sql.Open("pgx", os.Getenv("SETTLE_POSTGRES_URL"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ob, err := outbox.New(sqldb.Std(db, sqldb.Postgres), outbox.Config{NotifyAfterCommit: true})
	if err != nil {
		panic(err)
	}
	n, err := ob.NewNotifier()
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	go func() { _ = n.Run(ctx) }() // sends the NOTIFYs until Close
	defer n.Close()

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback()
	pub, _ := ob.TxPublisher(tx)
	if err := pub.Publish("orders.placed", message.NewMessage("A-17", []byte(`{"id":"A-17"}`))); err != nil {
		panic(err)
	}
	if err := tx.Commit(); err != nil {
		panic(err)
	}
	ob.Notify() // wakes this process's relays now, and the others through n
}

// On pgx the outbox takes the pool through sqldb.Pgx, and TxPublisher takes
// the application's pgx.Tx: the same methods, the same rows.
func ExampleNew_pgx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("SETTLE_POSTGRES_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	ob, err := outbox.New(sqldb.Pgx(pool), outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := ob.Check(ctx); err != nil { // the tables exist (see Schema)
		panic(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... the business writes on tx ...
		pub, err := ob.TxPublisher(tx)
		if err != nil {
			return err
		}
		return pub.Publish("orders.placed", message.NewMessage("A-17", []byte(`{"id":"A-17"}`)))
	})
	if err != nil {
		panic(err)
	}
	ob.Notify() // committed: a relay of this process forwards at once
}
