package outbox_test

import (
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// newSQLitePubSub returns a watermill-sql publisher and subscriber on db with
// the SQLite adapters, polling every 10ms.
func newSQLitePubSub(t *testing.T, db *sql.DB, group string) (*wsql.Publisher, *wsql.Subscriber) {
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
		PollInterval:     10 * time.Millisecond,
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
			return newSQLitePubSub(t, dbOf(t), "test")
		},
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return newSQLitePubSub(t, dbOf(t), group)
		},
	)
}
