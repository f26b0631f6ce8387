package dedupe_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/sqldb"
)

// The middleware runs the handler once per message UUID: a second delivery of
// the same message is acked without running it.
func ExampleNewMiddleware() {
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: dedupe.NewMemoryStore()})
	if err != nil {
		panic(err)
	}
	charge := dd(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Printf("charging order %s\n", msg.Payload)
		return nil, nil
	})

	first := message.NewMessage("msg-1", []byte("A-17"))
	redelivered := message.NewMessage("msg-1", []byte("A-17"))
	for _, m := range []*message.Message{first, redelivered} {
		if _, err := charge(m); err != nil {
			panic(err)
		}
	}
	// Output:
	// charging order A-17
}

// A key function makes "the same work" mean something other than "the same
// message": here, one charge per order, whichever message asks for it.
func ExampleMetadataKey() {
	dd, err := dedupe.NewMiddleware(dedupe.Config{
		Store: dedupe.NewMemoryStore(),
		Key:   dedupe.MetadataKey("order_id", "charge:"),
	})
	if err != nil {
		panic(err)
	}
	charge := dd(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("charging", msg.Metadata.Get("order_id"))
		return nil, nil
	})
	for _, uuid := range []string{"m1", "m2"} { // two messages, one order
		m := message.NewMessage(uuid, nil)
		m.Metadata.Set("order_id", "A-17")
		if _, err := charge(m); err != nil {
			panic(err)
		}
	}
	// Output:
	// charging A-17
}

// In a transaction, the claim commits together with the handler's own writes.
// A rolled-back attempt leaves nothing behind, and the committed one is final.
func ExampleSQLStore_WithTx() {
	dir, _ := os.MkdirTemp("", "settle-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(5000)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()

	store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.SQLite), dedupe.SQLConfig{})
	if err != nil {
		panic(err)
	}
	ddl := append(store.Schema(), `CREATE TABLE charges (order_id TEXT PRIMARY KEY, cents INTEGER)`)
	for _, stmt := range ddl {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			panic(err)
		}
	}

	// charge claims the key, writes the charge and confirms, all in one
	// transaction; fail makes it roll back after the write.
	charge := func(key string, fail bool) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() // no-op after Commit
		txStore := store.WithTx(tx)
		c, err := txStore.Claim(ctx, key, time.Minute)
		if err != nil {
			return err
		}
		if c.Result != dedupe.Acquired {
			fmt.Println(key, "->", c.Result)
			return nil
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO charges VALUES (?, 1999)`, key); err != nil {
			return err
		}
		if fail {
			return fmt.Errorf("card declined")
		}
		if err := txStore.Confirm(ctx, c); err != nil {
			return err
		}
		fmt.Println(key, "-> charged on attempt", c.Attempt)
		return tx.Commit()
	}

	fmt.Println("first try:", charge("order:A-17", true))
	_ = charge("order:A-17", false) // the redelivery
	_ = charge("order:A-17", false) // and a duplicate of it

	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM charges`).Scan(&n)
	fmt.Println("charges:", n)
	// Output:
	// first try: card declined
	// order:A-17 -> charged on attempt 1
	// order:A-17 -> duplicate
	// charges: 1
}

// The DDL of the claims table, for a migration: here PostgreSQL's. No
// connection is made.
func ExampleSQLStore_Schema() {
	db, err := sql.Open("pgx", "postgres://localhost/app")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.Postgres), dedupe.SQLConfig{})
	if err != nil {
		panic(err)
	}
	fmt.Println(store.Schema()[0])
	// Output:
	// CREATE TABLE IF NOT EXISTS "settle_dedupe" (
	// 	key        BYTEA    NOT NULL PRIMARY KEY,
	// 	state      SMALLINT NOT NULL,
	// 	token      TEXT     NOT NULL,
	// 	attempts   INTEGER  NOT NULL,
	// 	expires_at BIGINT   NOT NULL,
	// 	updated_at BIGINT   NOT NULL,
	// 	first_at   BIGINT   NOT NULL DEFAULT 0
	// )
}

// A partitioned claims table: a partition a day, which Prune drops whole
// once the day is past the retention.
func ExampleSQLStore_Schema_partitioned() {
	store, err := dedupe.NewSQLStore(sqldb.Std(nil, sqldb.Postgres), dedupe.SQLConfig{Partition: 24 * time.Hour})
	if err != nil {
		panic(err)
	}
	for _, stmt := range store.Schema() {
		fmt.Println(stmt)
	}
	// Output:
	// CREATE TABLE IF NOT EXISTS "settle_dedupe" (
	// 	key        BYTEA    NOT NULL,
	// 	state      SMALLINT NOT NULL,
	// 	token      TEXT     NOT NULL,
	// 	attempts   INTEGER  NOT NULL,
	// 	expires_at BIGINT   NOT NULL,
	// 	updated_at BIGINT   NOT NULL,
	// 	first_at   BIGINT   NOT NULL DEFAULT 0,
	// 	until_at   BIGINT   NOT NULL,
	// 	PRIMARY KEY (key, until_at)
	// ) PARTITION BY RANGE (until_at)
	// CREATE INDEX IF NOT EXISTS "settle_dedupe_updated_at_idx" ON "settle_dedupe" (updated_at)
}

// Keys are scoped to the logical handler: pipeline's competing subscriptions
// charge, charge#2, ... are one handler, and its keys are stored under it.
func ExampleScopedKey() {
	scope := "charge" // the scope of charge, charge#2, ...
	fmt.Println(scope)
	fmt.Printf("%q\n", dedupe.ScopedKey(scope, "order-17"))
	fmt.Printf("%q\n", dedupe.ScopedKey("", "order-17")) // no handler: unscoped
	// An unscoped key that spells charge's is stored apart from it.
	fmt.Printf("%q\n", dedupe.ScopedKey("", "charge\x00order-17"))
	// Output:
	// charge
	// "charge\x00order-17"
	// "order-17"
	// "\x000:charge\x00order-17"
}

// Lookup answers "was order 17 charged by handler charge, after how many
// attempts?" from the claims table, where the key is stored with its scope
// and the times as microseconds; InFlight lists the claims held now.
func ExampleSQLStore_Lookup() {
	dir, _ := os.MkdirTemp("", "settle-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(5000)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()
	store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.SQLite), dedupe.SQLConfig{})
	if err != nil {
		panic(err)
	}
	for _, stmt := range store.Schema() {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			panic(err)
		}
	}
	// Handler charge ran order-17 twice: the first run failed, the second
	// was confirmed. It is running order-18 now.
	key := dedupe.ScopedKey("charge", "order-17")
	c, _ := store.Claim(ctx, key, time.Minute)
	_ = store.Release(ctx, c)
	c, _ = store.Claim(ctx, key, time.Minute)
	_ = store.Confirm(ctx, c)
	_, _ = store.Claim(ctx, dedupe.ScopedKey("charge", "order-18"), time.Minute)

	st, found, err := store.Lookup(ctx, "charge", "order-17")
	if err != nil {
		panic(err)
	}
	fmt.Println(found, st.State, "after", st.Attempts, "attempts")
	_, found, _ = store.Lookup(ctx, "refund", "order-17")
	fmt.Println("refund:", found)
	held, _ := store.InFlight(ctx, 10)
	for _, h := range held {
		fmt.Println("in flight:", h.Scope, h.Key)
	}
	// Output:
	// true confirmed after 2 attempts
	// refund: false
	// in flight: charge order-18
}
