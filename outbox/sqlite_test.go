package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// ackDeadline is below the busy timeout of internal/sqlurl.SQLiteDSN (10s),
// as SQLiteSchema's doc asks: a subscriber whose consumer does not take a
// message gives up SQLite's write lock after it, so waiting writers get in.
var ackDeadline = time.Second

// newSQLitePubSub returns a watermill-sql publisher and subscriber on db with
// the SQLite adapters, polling every 10ms.
func newSQLitePubSub(t *testing.T, db *sql.DB, group string) (*wsql.Publisher, *wsql.Subscriber) {
	t.Helper()
	return newSQLitePubSubPolling(t, db, group, 10*time.Millisecond)
}

func newSQLitePubSubPolling(t *testing.T, db *sql.DB, group string, poll time.Duration) (*wsql.Publisher, *wsql.Subscriber) {
	t.Helper()
	beginner := wsql.BeginnerFromStdSQL(db)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{
		SchemaAdapter:        outbox.SQLiteSchema{},
		AutoInitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup:    group,
		PollInterval:     poll,
		AckDeadline:      &ackDeadline,
		ResendInterval:   5 * time.Millisecond,
		RetryInterval:    10 * time.Millisecond,
		SchemaAdapter:    outbox.SQLiteSchema{},
		OffsetsAdapter:   outbox.SQLiteOffsetsAdapter{},
		InitializeSchema: false,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = pub.Close()
		_ = sub.Close()
	})
	return pub, sub
}

// suitePollInterval is the subscribers' poll interval in Watermill's suite.
// Some of its tests publish, from the goroutine that reads the messages,
// while a subscriber waits for that goroutine to take a message, holding
// SQLite's write lock: the publisher gets in only when the subscriber gives
// up at its AckDeadline and pauses for one poll interval. SQLite's busy
// handler retries a waiting writer every 100ms at most, so the pause must
// be at least that long for the publisher to be sure to see it.
const suitePollInterval = 100 * time.Millisecond

// TestSQLitePubSub runs Watermill's own Pub/Sub conformance suite on a SQLite
// file through watermill-sql and the SQLite adapters.
func TestSQLitePubSub(t *testing.T) {
	t.Parallel()
	// Each test of the suite gets its own SQLite file, shared by every
	// publisher and subscriber it creates: a subscriber holds the file's
	// write lock while its consumer has not taken a message, so one test's
	// idle subscriber would stall the others' writers (see SQLiteSchema).
	var (
		mu  sync.Mutex
		dbs = map[*testing.T]*sql.DB{}
	)
	dbOf := func(t *testing.T) *sql.DB {
		mu.Lock()
		defer mu.Unlock()
		if db, ok := dbs[t]; ok {
			return db
		}
		db := testenv.SQLite(t).DB
		dbs[t] = db
		t.Cleanup(func() {
			mu.Lock()
			defer mu.Unlock()
			delete(dbs, t)
		})
		return db
	}
	features := tests.Features{
		ConsumerGroups:      true,
		ExactlyOnceDelivery: true,
		GuaranteedOrder:     true,
		Persistent:          true,
	}
	tests.TestPubSub(t, features,
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			return newSQLitePubSubPolling(t, dbOf(t), "test", suitePollInterval)
		},
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return newSQLitePubSubPolling(t, dbOf(t), group, suitePollInterval)
		},
	)
}

// openSQLite opens a new SQLite file with settle's DSN, or with the same DSN
// less _txlock=immediate when immediate is false (deferred transactions).
func openSQLite(t *testing.T, immediate bool) *sql.DB {
	t.Helper()
	dsn := sqlurl.SQLiteDSN(filepath.Join(t.TempDir(), "outbox.db"))
	if !immediate {
		deferred := strings.Replace(dsn, "&_txlock=immediate", "", 1)
		if deferred == dsn {
			t.Fatalf("DSN %q has no _txlock=immediate to remove", dsn)
		}
		dsn = deferred
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(4)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

var txModes = []struct {
	name      string
	immediate bool
}{
	{"begin_immediate", true},
	{"begin_deferred", false},
}

func initTopic(t *testing.T, sub *wsql.Subscriber, topic string) {
	t.Helper()
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
}

func receive(t *testing.T, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m, ok := <-msgs:
		if !ok {
			t.Fatal("messages channel closed")
		}
		m.Ack()
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no message within 10s")
	}
	return nil
}

// expectNone asserts that no message arrives within d. Absence cannot be
// polled for, so this waits the whole d (many poll intervals).
func expectNone(t *testing.T, msgs <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m := <-msgs:
		t.Fatalf("unexpected message %s (payload %q)", m.UUID, m.Payload)
	case <-time.After(d):
	}
}

func countRows(t *testing.T, db *sql.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(t.Context(), `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitAcked waits until the consumer group's acked offset in the offsets
// table is want: a subscriber commits its ack after handing the message out.
func waitAcked(t *testing.T, db *sql.DB, table, group string, want int64) {
	t.Helper()
	var acked int64
	for deadline := time.Now().Add(10 * time.Second); ; {
		err := db.QueryRowContext(t.Context(), `SELECT "offset_acked" FROM `+table+` WHERE "consumer_group" = ?`, group).Scan(&acked)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			t.Fatal(err)
		}
		if err == nil && acked == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("group %q: offset_acked = %d (err %v) after 10s, want %d", group, acked, err, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSQLiteTxPublisher publishes through a watermill-sql publisher bound to
// a *sql.Tx: the subscriber gets the message only after Commit, and never a
// message whose transaction rolled back.
func TestSQLiteTxPublisher(t *testing.T) {
	t.Parallel()
	for _, mode := range txModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			db := openSQLite(t, mode.immediate)
			topic := "orders"
			dbPub, sub := newSQLitePubSub(t, db, "")
			initTopic(t, sub, topic)
			msgs, err := sub.Subscribe(t.Context(), topic)
			if err != nil {
				t.Fatal(err)
			}

			publishInTx := func(payload string) *sql.Tx {
				t.Helper()
				tx, err := db.BeginTx(t.Context(), nil)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = tx.Rollback() })
				pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: outbox.SQLiteSchema{}}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(payload))); err != nil {
					t.Fatal(err)
				}
				return tx
			}

			tx := publishInTx("committed")
			expectNone(t, msgs, 300*time.Millisecond)
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if got := receive(t, msgs); string(got.Payload) != "committed" {
				t.Fatalf("got payload %q, want committed", got.Payload)
			}

			tx = publishInTx("rolled back")
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			// Offsets are delivered in order, so had the rolled-back row been
			// kept it would arrive before this one.
			if err := dbPub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("after"))); err != nil {
				t.Fatal(err)
			}
			if got := receive(t, msgs); string(got.Payload) != "after" {
				t.Fatalf("got payload %q, want after", got.Payload)
			}
			expectNone(t, msgs, 100*time.Millisecond)
			if n := countRows(t, db, outbox.SQLiteSchema{}.MessagesTable(topic)); n != 2 {
				t.Fatalf("messages table has %d rows, want 2", n)
			}
		})
	}
}

// TestSQLiteConsumerGroupsExactlyOnce runs three subscribers in one consumer
// group and one in another while two publishers write: each group gets every
// message exactly once, with BEGIN IMMEDIATE and with deferred transactions.
func TestSQLiteConsumerGroupsExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range txModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			db := openSQLite(t, mode.immediate)
			const topic, perPublisher = "events", 150
			type delivery struct{ group, payload string }
			var (
				mu    sync.Mutex
				got   = map[delivery]int{}
				total int
				wg    sync.WaitGroup
			)
			// Cleanups run last-in first-out: the subscribers registered
			// below close first, ending the collectors this waits for.
			t.Cleanup(wg.Wait)
			pub, first := newSQLitePubSub(t, db, "shared")
			initTopic(t, first, topic)

			subscribe := func(sub *wsql.Subscriber, group string) {
				msgs, err := sub.Subscribe(t.Context(), topic)
				if err != nil {
					t.Fatal(err)
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					for m := range msgs {
						mu.Lock()
						got[delivery{group, string(m.Payload)}]++
						total++
						mu.Unlock()
						m.Ack()
					}
				}()
			}
			subscribe(first, "shared")
			for range 2 {
				_, sub := newSQLitePubSub(t, db, "shared")
				subscribe(sub, "shared")
			}
			_, other := newSQLitePubSub(t, db, "other")
			subscribe(other, "other")

			var pubWG sync.WaitGroup
			for p := range 2 {
				pubWG.Add(1)
				go func() {
					defer pubWG.Done()
					for i := range perPublisher {
						msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d-%d", p, i))
						if err := pub.Publish(topic, msg); err != nil {
							t.Error(err)
							return
						}
					}
				}()
			}
			pubWG.Wait()

			want := 2 * 2 * perPublisher // two groups
			deadline := time.Now().Add(30 * time.Second)
			for {
				mu.Lock()
				n := total
				mu.Unlock()
				if n >= want {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("received %d deliveries in 30s, want %d", n, want)
				}
				time.Sleep(10 * time.Millisecond)
			}
			// Give duplicates, if any, time to show up.
			time.Sleep(200 * time.Millisecond)

			mu.Lock()
			defer mu.Unlock()
			if total != want {
				t.Errorf("received %d deliveries, want %d", total, want)
			}
			for _, group := range []string{"shared", "other"} {
				for p := range 2 {
					for i := range perPublisher {
						d := delivery{group, fmt.Sprintf("%d-%d", p, i)}
						if got[d] != 1 {
							t.Errorf("group %s got %s %d times, want once", group, d.payload, got[d])
						}
					}
				}
			}

			var maxOffset int64
			if err := db.QueryRowContext(t.Context(), `SELECT max("offset") FROM `+outbox.SQLiteSchema{}.MessagesTable(topic)).Scan(&maxOffset); err != nil {
				t.Fatal(err)
			}
			if maxOffset != 2*perPublisher {
				t.Errorf("max offset %d, want %d", maxOffset, 2*perPublisher)
			}
			offsets := outbox.SQLiteOffsetsAdapter{}.MessagesOffsetsTable(topic)
			waitAcked(t, db, offsets, "shared", maxOffset)
			waitAcked(t, db, offsets, "other", maxOffset)
		})
	}
}

// TestSQLiteSubscribeIsolationLevel checks that modernc.org/sqlite begins a
// transaction at the level the subscriber asks for.
func TestSQLiteSubscribeIsolationLevel(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	level := outbox.SQLiteSchema{}.SubscribeIsolationLevel()
	if level != sql.LevelSerializable {
		t.Fatalf("SubscribeIsolationLevel() = %v, want %v", level, sql.LevelSerializable)
	}
	tx, err := db.BeginTx(t.Context(), &sql.TxOptions{Isolation: level})
	if err != nil {
		t.Fatalf("BeginTx at %v: %v", level, err)
	}
	if _, err := tx.ExecContext(t.Context(), `CREATE TABLE t (x INTEGER)`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// TestSQLiteMessageRoundTrip checks what survives the table: UUIDs longer
// than watermill-sql's 36-character columns, binary and empty payloads,
// metadata, and custom table names.
func TestSQLiteMessageRoundTrip(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	schema := outbox.SQLiteSchema{GenerateMessagesTableName: func(topic string) string { return `"my_outbox_` + topic + `"` }}
	offsets := outbox.SQLiteOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string { return `"my_offsets_` + topic + `"` }}
	beginner := wsql.BeginnerFromStdSQL(db)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: schema}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		PollInterval: 10 * time.Millisecond, SchemaAdapter: schema, OffsetsAdapter: offsets,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	const topic = "round.trip"
	initTopic(t, sub, topic)

	long := message.NewMessage(strings.Repeat("k", 3000), []byte{0, 1, 2, 0xff})
	long.Metadata.Set("settle_reason", `quotes " and \ back`)
	long.Metadata.Set("empty", "")
	empty := message.NewMessage("empty-payload", nil)
	if err := pub.Publish(topic, long, empty); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic); err != nil {
		t.Fatalf("publishing no messages: %v", err)
	}
	if n := countRows(t, db, `"my_outbox_round.trip"`); n != 2 {
		t.Fatalf("custom table has %d rows, want 2", n)
	}

	msgs, err := sub.Subscribe(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	got := receive(t, msgs)
	if got.UUID != long.UUID {
		t.Errorf("UUID of %d bytes came back as %d bytes", len(long.UUID), len(got.UUID))
	}
	if !bytes.Equal(got.Payload, long.Payload) {
		t.Errorf("payload %x, want %x", got.Payload, long.Payload)
	}
	if len(got.Metadata) != 2 || got.Metadata.Get("settle_reason") != long.Metadata.Get("settle_reason") || got.Metadata.Get("empty") != "" {
		t.Errorf("metadata %v, want %v", got.Metadata, long.Metadata)
	}
	got = receive(t, msgs)
	if got.UUID != "empty-payload" || len(got.Payload) != 0 || got.Metadata == nil {
		t.Errorf("got %s payload %q metadata %v, want empty-payload with no payload and an empty, usable metadata map", got.UUID, got.Payload, got.Metadata)
	}
	waitAcked(t, db, `"my_offsets_round.trip"`, "", 2)
}

// TestSQLiteAdapterErrors checks the errors the adapters return when called
// directly with bad input.
func TestSQLiteAdapterErrors(t *testing.T) {
	t.Parallel()
	schema := outbox.SQLiteSchema{}
	offsets := outbox.SQLiteOffsetsAdapter{}
	for _, topic := range []string{"", "has space", `x"; DROP TABLE y; --`, "semi;colon", "quote'"} {
		t.Run(fmt.Sprintf("topic %q", topic), func(t *testing.T) {
			t.Parallel()
			calls := map[string]func() error{
				"SchemaInitializingQueries": func() error {
					_, err := schema.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: topic})
					return err
				},
				"InsertQuery": func() error {
					_, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: topic, Msgs: message.Messages{message.NewMessage("1", nil)}})
					return err
				},
				"SelectQuery": func() error {
					_, err := schema.SelectQuery(wsql.SelectQueryParams{Topic: topic, OffsetsAdapter: offsets})
					return err
				},
				"offsets.SchemaInitializingQueries": func() error {
					_, err := offsets.SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: topic})
					return err
				},
				"NextOffsetQuery": func() error {
					_, err := offsets.NextOffsetQuery(wsql.NextOffsetQueryParams{Topic: topic})
					return err
				},
				"AckMessageQuery": func() error {
					_, err := offsets.AckMessageQuery(wsql.AckMessageQueryParams{Topic: topic})
					return err
				},
				"ConsumedMessageQuery": func() error {
					_, err := offsets.ConsumedMessageQuery(wsql.ConsumedMessageQueryParams{Topic: topic})
					return err
				},
				"BeforeSubscribingQueries": func() error {
					_, err := offsets.BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams{Topic: topic})
					return err
				},
			}
			for name, call := range calls {
				if err := call(); !errors.Is(err, wsql.ErrInvalidTopicName) {
					t.Errorf("%s: err = %v, want ErrInvalidTopicName", name, err)
				}
			}
		})
	}

	t.Run("negative batch size", func(t *testing.T) {
		t.Parallel()
		bad := outbox.SQLiteSchema{SubscribeBatchSize: -1}
		if err := bad.Validate(); !errors.Is(err, outbox.ErrInvalidBatchSize) {
			t.Errorf("Validate: err = %v, want ErrInvalidBatchSize", err)
		}
		if _, err := bad.SelectQuery(wsql.SelectQueryParams{Topic: "t", OffsetsAdapter: offsets}); !errors.Is(err, outbox.ErrInvalidBatchSize) {
			t.Errorf("SelectQuery: err = %v, want ErrInvalidBatchSize", err)
		}
		if err := (outbox.SQLiteSchema{}).Validate(); err != nil {
			t.Errorf("zero value: Validate() = %v", err)
		}
	})

	t.Run("publish batch too large", func(t *testing.T) {
		t.Parallel()
		msgs := make(message.Messages, outbox.SQLiteMaxPublishBatch+1)
		for i := range msgs {
			msgs[i] = message.NewMessage(strconv.Itoa(i), nil)
		}
		if _, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: "t", Msgs: msgs}); !errors.Is(err, outbox.ErrPublishBatchTooLarge) {
			t.Errorf("err = %v, want ErrPublishBatchTooLarge", err)
		}
		q, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: "t", Msgs: msgs[:outbox.SQLiteMaxPublishBatch]})
		if err != nil {
			t.Fatal(err)
		}
		if len(q.Args) != 3*outbox.SQLiteMaxPublishBatch {
			t.Errorf("%d args, want %d", len(q.Args), 3*outbox.SQLiteMaxPublishBatch)
		}
	})
}

// TestSQLiteMaxPublishBatch publishes the largest batch in one statement.
func TestSQLiteMaxPublishBatch(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	pub, sub := newSQLitePubSub(t, db, "")
	initTopic(t, sub, "big")
	msgs := make(message.Messages, outbox.SQLiteMaxPublishBatch)
	for i := range msgs {
		msgs[i] = message.NewMessage(strconv.Itoa(i), nil)
	}
	if err := pub.Publish("big", msgs...); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, db, outbox.SQLiteSchema{}.MessagesTable("big")); n != len(msgs) {
		t.Fatalf("%d rows, want %d", n, len(msgs))
	}
}

// TestSQLiteOffsetsSurvivePruning deletes every consumed row, as an outbox
// that prunes forwarded messages does: offsets are never reused, so the next
// message is still delivered.
func TestSQLiteOffsetsSurvivePruning(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	const topic = "pruned"
	pub, sub := newSQLitePubSub(t, db, "")
	initTopic(t, sub, topic)
	msgs, err := sub.Subscribe(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	// One Publish: a second one would wait for the write lock the
	// subscriber holds while this goroutine has not taken the first message.
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a")), message.NewMessage(watermill.NewUUID(), []byte("b"))); err != nil {
		t.Fatal(err)
	}
	receive(t, msgs)
	receive(t, msgs)
	table := outbox.SQLiteSchema{}.MessagesTable(topic)
	waitAcked(t, db, outbox.SQLiteOffsetsAdapter{}.MessagesOffsetsTable(topic), "", 2)
	if _, err := db.ExecContext(t.Context(), `DELETE FROM `+table); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("c"))); err != nil {
		t.Fatal(err)
	}
	if got := receive(t, msgs); string(got.Payload) != "c" {
		t.Fatalf("got payload %q, want c", got.Payload)
	}
}

// ExampleSQLiteSchema writes an order and its event in one transaction on a
// SQLite file, and reads the event back with a watermill-sql subscriber.
func ExampleSQLiteSchema() {
	dir, err := os.MkdirTemp("", "outbox-example")
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

	schema, offsets := outbox.SQLiteSchema{}, outbox.SQLiteOffsetsAdapter{}
	ackDeadline := 5 * time.Second // below the busy timeout
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		PollInterval:   10 * time.Millisecond,
		AckDeadline:    &ackDeadline,
		SchemaAdapter:  schema,
		OffsetsAdapter: offsets,
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
