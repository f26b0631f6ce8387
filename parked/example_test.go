package parked_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "modernc.org/sqlite"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// Two orders fail the same way and are parked; they are one failure
// group. After the fix, the group is replayed once through the outbox, and
// a second replay finds nothing left to replay.
func Example() {
	dir, _ := os.MkdirTemp("", "parked-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()
	drv := sqldb.Std(db, sqldb.SQLite)

	store, err := parked.New(drv, parked.Config{})
	if err != nil {
		panic(err)
	}
	ob, err := outbox.New(drv, outbox.Config{})
	if err != nil {
		panic(err)
	}
	for _, stmt := range store.Schema() { // normally in your migrations
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			panic(err)
		}
	}
	if err := ob.InitSchema(ctx); err != nil {
		panic(err)
	}
	if err := store.Check(ctx); err != nil {
		panic(err)
	}

	// What the parking middleware does with a dead-lettered message
	// (set the store as its ParkConfig.Store).
	errDeclined := errors.New("card declined")
	for _, order := range []string{"17", "18"} {
		msg := message.NewMessage("msg-"+order, []byte(`{"order":`+order+`}`))
		err := store.Park(ctx, settle.Parked{
			Message: msg, Outcome: settle.DeadLettered, Handler: "charge", Topic: "orders",
			Cause: fmt.Errorf("order %s: %w", order, errDeclined), Attempts: 3, LastFailure: time.Now(),
		})
		if err != nil {
			panic(err)
		}
	}

	groups, _ := store.Groups(ctx, parked.Filter{})
	for _, g := range groups {
		fmt.Printf("group %q of %s: %d parked\n", g.Text, g.Handler, g.Parked)
	}

	f := parked.Filter{Group: groups[0].ID}
	preview, _ := store.Preview(ctx, f, parked.ReplayOptions{})
	fmt.Println("would replay:", preview.Replayed, preview.Destinations)
	res, err := store.Replay(ctx, ob, f, parked.ReplayOptions{By: "alice"})
	fmt.Println("replayed:", res.Replayed, err)
	res, _ = store.Replay(ctx, ob, f, parked.ReplayOptions{By: "bob"})
	fmt.Println("second replay:", res.Replayed, "replayed,", res.Skipped, "skipped")

	// The relay publishes the copies.
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer broker.Close()
	n, _ := ob.Forward(ctx, broker, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	fmt.Println("published:", n)
	copies, _ := broker.Subscribe(ctx, "orders")
	var lines []string
	for range n {
		m := <-copies
		lines = append(lines, fmt.Sprint(string(m.Payload), " replay of ", m.Metadata.Get(settle.MetaReplayOf), " by ", m.Metadata.Get(settle.MetaReplayedBy)))
		m.Ack()
	}
	slices.Sort(lines)
	fmt.Println(strings.Join(lines, "\n"))
	// Output:
	// group "order <n>: card declined" of charge: 2 parked
	// would replay: 2 map[orders:2]
	// replayed: 2 <nil>
	// second replay: 0 replayed, 2 skipped
	// published: 2
	// {"order":17} replay of msg-17 by alice
	// {"order":18} replay of msg-18 by alice
}
