package sqlitepubsub_test

import (
	"bytes"
	"database/sql"
	"errors"
	"fmt"
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

	_ "modernc.org/sqlite" // registers "sqlite"

	"github.com/settle-go/settle/sqlitepubsub"
)

// ackDeadline is below the busy timeout of openSQLite's DSN (10s), as the
// package doc asks: a subscriber whose consumer does not take a message
// gives up SQLite's write lock after it, so waiting writers get in.
var ackDeadline = time.Second

// newPubSub returns a watermill-sql publisher and subscriber on db with
// the SQLite adapters, polling every 10ms.
func newPubSub(t *testing.T, db *sql.DB, group string) (*wsql.Publisher, *wsql.Subscriber) {
	t.Helper()
	return newPubSubPolling(t, db, group, 10*time.Millisecond)
}

func newPubSubPolling(t *testing.T, db *sql.DB, group string, poll time.Duration) (*wsql.Publisher, *wsql.Subscriber) {
	t.Helper()
	beginner := wsql.BeginnerFromStdSQL(db)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{
		SchemaAdapter:        newSchema(t, sqlitepubsub.Config{}),
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
		SchemaAdapter:    newSchema(t, sqlitepubsub.Config{}),
		OffsetsAdapter:   sqlitepubsub.Offsets(sqlitepubsub.Config{}),
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

// TestPubSub runs Watermill's own Pub/Sub conformance suite on a SQLite
// file through watermill-sql and the SQLite adapters.
func TestPubSub(t *testing.T) {
	t.Parallel()
	// Each test of the suite gets its own SQLite file, shared by every
	// publisher and subscriber it creates: a subscriber holds the file's
	// write lock while its consumer has not taken a message, so one test's
	// idle subscriber would stall the others' writers (see the package doc).
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
		db := openSQLite(t, true)
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
			return newPubSubPolling(t, dbOf(t), "test", suitePollInterval)
		},
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return newPubSubPolling(t, dbOf(t), group, suitePollInterval)
		},
	)
}

// openSQLite opens a new SQLite file with the DSN the package doc asks for
// (and synchronous=NORMAL, which only makes commits cheaper), or with the
// same DSN less _txlock=immediate when immediate is false (deferred
// transactions).
func openSQLite(t *testing.T, immediate bool) *sql.DB {
	t.Helper()
	dsn := "file:" + filepath.Join(t.TempDir(), "pubsub.db") + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_txlock=immediate"
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

// TestTxPublisher publishes through a watermill-sql publisher bound to
// a *sql.Tx: the subscriber gets the message only after Commit, and never a
// message whose transaction rolled back.
func TestTxPublisher(t *testing.T) {
	t.Parallel()
	for _, mode := range txModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			db := openSQLite(t, mode.immediate)
			topic := "orders"
			dbPub, sub := newPubSub(t, db, "")
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
				pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: newSchema(t, sqlitepubsub.Config{})}, nil)
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
			if n := countRows(t, db, messagesTable(topic)); n != 2 {
				t.Fatalf("messages table has %d rows, want 2", n)
			}
		})
	}
}

// TestConsumerGroupsExactlyOnce runs three subscribers in one consumer
// group and one in another while two publishers write: each group gets every
// message exactly once, with BEGIN IMMEDIATE and with deferred transactions.
func TestConsumerGroupsExactlyOnce(t *testing.T) {
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
			pub, first := newPubSub(t, db, "shared")
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
				_, sub := newPubSub(t, db, "shared")
				subscribe(sub, "shared")
			}
			_, other := newPubSub(t, db, "other")
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
			if err := db.QueryRowContext(t.Context(), `SELECT max("offset") FROM `+messagesTable(topic)).Scan(&maxOffset); err != nil {
				t.Fatal(err)
			}
			if maxOffset != 2*perPublisher {
				t.Errorf("max offset %d, want %d", maxOffset, 2*perPublisher)
			}
			offsets := offsetsTable(topic)
			waitAcked(t, db, offsets, "shared", maxOffset)
			waitAcked(t, db, offsets, "other", maxOffset)
		})
	}
}

// TestSubscribeIsolationLevel checks that modernc.org/sqlite begins a
// transaction at the level the subscriber asks for.
func TestSubscribeIsolationLevel(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	level := newSchema(t, sqlitepubsub.Config{}).SubscribeIsolationLevel()
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

// TestMessageRoundTrip checks what survives the table: UUIDs longer
// than watermill-sql's 36-character columns, binary and empty payloads,
// metadata, and custom table names.
func TestMessageRoundTrip(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	cfg := sqlitepubsub.Config{
		GenerateMessagesTableName:        func(topic string) string { return `"my_messages_` + topic + `"` },
		GenerateMessagesOffsetsTableName: func(topic string) string { return `"my_offsets_` + topic + `"` },
	}
	schema, offsets := newSchema(t, cfg), sqlitepubsub.Offsets(cfg)
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
	if n := countRows(t, db, `"my_messages_round.trip"`); n != 2 {
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

// TestAdapterErrors checks the errors the adapters return when called
// directly with bad input.
func TestAdapterErrors(t *testing.T) {
	t.Parallel()
	schema := newSchema(t, sqlitepubsub.Config{})
	offsets := sqlitepubsub.Offsets(sqlitepubsub.Config{})
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
		if s, err := sqlitepubsub.Schema(sqlitepubsub.Config{SubscribeBatchSize: -1}); err == nil || !strings.Contains(err.Error(), "SubscribeBatchSize") {
			t.Errorf("Schema(SubscribeBatchSize: -1) = %v, %v; want an error naming SubscribeBatchSize", s, err)
		}
	})

	t.Run("publish batch too large", func(t *testing.T) {
		t.Parallel()
		msgs := make(message.Messages, sqlitepubsub.MaxPublishBatch+1)
		for i := range msgs {
			msgs[i] = message.NewMessage(strconv.Itoa(i), nil)
		}
		if _, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: "t", Msgs: msgs}); !errors.Is(err, sqlitepubsub.ErrPublishBatchTooLarge) {
			t.Errorf("err = %v, want ErrPublishBatchTooLarge", err)
		}
		q, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: "t", Msgs: msgs[:sqlitepubsub.MaxPublishBatch]})
		if err != nil {
			t.Fatal(err)
		}
		if len(q.Args) != 3*sqlitepubsub.MaxPublishBatch {
			t.Errorf("%d args, want %d", len(q.Args), 3*sqlitepubsub.MaxPublishBatch)
		}
	})
}

// TestMaxPublishBatch publishes the largest batch in one statement.
func TestMaxPublishBatch(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	pub, sub := newPubSub(t, db, "")
	initTopic(t, sub, "big")
	msgs := make(message.Messages, sqlitepubsub.MaxPublishBatch)
	for i := range msgs {
		msgs[i] = message.NewMessage(strconv.Itoa(i), nil)
	}
	if err := pub.Publish("big", msgs...); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, db, messagesTable("big")); n != len(msgs) {
		t.Fatalf("%d rows, want %d", n, len(msgs))
	}
}

// TestOffsetsSurvivePruning deletes every consumed row, as an application
// that prunes delivered messages does: offsets are never reused, so the next
// message is still delivered.
func TestOffsetsSurvivePruning(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	const topic = "pruned"
	pub, sub := newPubSub(t, db, "")
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
	table := messagesTable(topic)
	waitAcked(t, db, offsetsTable(topic), "", 2)
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

// newSchema is sqlitepubsub.Schema(cfg), failing the test on an error.
func newSchema(t testing.TB, cfg sqlitepubsub.Config) wsql.SchemaAdapter {
	t.Helper()
	s, err := sqlitepubsub.Schema(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// messagesTable and offsetsTable are the default table names of topic, as
// the package doc gives them.
func messagesTable(topic string) string { return `"watermill_` + topic + `"` }
func offsetsTable(topic string) string  { return `"watermill_offsets_` + topic + `"` }
