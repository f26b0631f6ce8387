package sqlitepubsub_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "modernc.org/sqlite" // registers "sqlite"

	"github.com/settle-go/settle/sqlitepubsub"
)

// An order and its event are written in one transaction on a SQLite file,
// and a watermill-sql subscriber reads the event back.
func Example() {
	dir, err := os.MkdirTemp("", "sqlitepubsub-example")
	if err != nil {
		panic(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	// modernc.org/sqlite, with WAL, a busy timeout and BEGIN IMMEDIATE.
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "app.db")+
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer func() { _ = db.Close() }()

	var cfg sqlitepubsub.Config // watermill-sql's table names, 100 rows a poll
	schema, err := sqlitepubsub.Schema(cfg)
	if err != nil {
		panic(err)
	}
	ackDeadline := 5 * time.Second // below the busy timeout
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		PollInterval:   10 * time.Millisecond,
		AckDeadline:    &ackDeadline,
		SchemaAdapter:  schema,
		OffsetsAdapter: sqlitepubsub.Offsets(cfg),
	}, nil)
	if err != nil {
		panic(err)
	}
	defer func() { _ = sub.Close() }()
	// Schema as code: create the tables once, before anything runs.
	if err := sub.SubscribeInitialize("orders"); err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`); err != nil {
		panic(err)
	}

	// The order and its event commit together, or neither does.
	tx, err := db.Begin()
	if err != nil {
		panic(err)
	}
	if _, err := tx.Exec(`INSERT INTO orders (id) VALUES ('A-1')`); err != nil {
		panic(err)
	}
	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: schema}, nil)
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte(`{"order":"A-1"}`))); err != nil {
		panic(err)
	}
	if err := tx.Commit(); err != nil {
		panic(err)
	}

	msgs, err := sub.Subscribe(context.Background(), "orders")
	if err != nil {
		panic(err)
	}
	msg := <-msgs
	msg.Ack()
	fmt.Println(string(msg.Payload))
	// Output: {"order":"A-1"}
}
