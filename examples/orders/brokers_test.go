package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// malformed is the example's undecodable payload: not JSON.
var malformed = []byte(`{"order_id": 17, "cents": "a lot"`)

// watermill-sql's PostgreSQL schema makes the payload column JSON unless
// told otherwise. What that does to messages settle handles and forwards:
//   - a payload that is not JSON is refused at publish time (so it never
//     reaches a consumer, nor settle's poison parking), and a UUID longer
//     than 36 characters too;
//   - settle's outbox relay, forwarding such a row to such a topic, gets
//     the refusal from Publish: the row is retried, then set aside (never
//     marked forwarded), while the rows behind it are forwarded;
//   - a BYTEA column, as the example uses, takes the payload as it is and
//     delivers it byte for byte.
func TestWatermillSQLPayloadColumn(t *testing.T) {
	db := testenv.Postgres(t)
	logger := watermill.NopLogger{}
	ctx := t.Context()
	count := func(topic string) int {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM "watermill_`+topic+`"`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	newPubSub := func(t *testing.T, schema wsql.SchemaAdapter) (string, *wsql.Publisher, *wsql.Subscriber) {
		t.Helper()
		topic := "wsql_payload_" + newRunID(time.Now())
		pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db.DB), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
		if err != nil {
			t.Fatal(err)
		}
		sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
			ConsumerGroup: "test", SchemaAdapter: schema, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
			PollInterval: 10 * time.Millisecond,
		}, logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = sub.Close()
			_ = pub.Close()
			for _, table := range []string{"watermill_" + topic, "watermill_offsets_" + topic} {
				_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`"`)
			}
		})
		if err := sub.SubscribeInitialize(topic); err != nil {
			t.Fatal(err)
		}
		return topic, pub, sub
	}

	t.Run("JSON column refuses at publish", func(t *testing.T) {
		topic, pub, _ := newPubSub(t, wsql.DefaultPostgreSQLSchema{})
		err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), malformed))
		if err == nil || !strings.Contains(err.Error(), "json") {
			t.Errorf("publishing a payload that is not JSON into a JSON column: %v; want PostgreSQL's refusal", err)
		}
		err = pub.Publish(topic, message.NewMessage(strings.Repeat("u", 37), []byte(`{}`)))
		if err == nil || !strings.Contains(err.Error(), "character varying(36)") {
			t.Errorf("publishing a 37-character UUID: %v; want PostgreSQL's refusal", err)
		}
		if n := count(topic); n != 0 {
			t.Errorf("%d rows in the topic's table, want 0", n)
		}
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"A-001"}`))); err != nil {
			t.Fatalf("publishing JSON: %v", err)
		}
		if n := count(topic); n != 1 {
			t.Errorf("%d rows in the topic's table, want 1", n)
		}
	})

	t.Run("the outbox relay sets the refused row aside", func(t *testing.T) {
		topic, pub, _ := newPubSub(t, wsql.DefaultPostgreSQLSchema{})
		ob, err := outbox.New(sqldb.Std(db.DB, sqldb.Postgres), outbox.Config{Topic: "ob_payload_" + newRunID(time.Now())})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.InitSchema(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for _, table := range []string{ob.Table(), ob.Table() + "_relays"} {
				_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`"`)
			}
		})
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		txPub, err := ob.TxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		good := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"A-002"}`))
		if err := txPub.Publish(topic, message.NewMessage(watermill.NewUUID(), malformed), good); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		relay, err := ob.NewRelay(pub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, RetryInterval: 10 * time.Millisecond, MaxAttempts: 3})
		if err != nil {
			t.Fatal(err)
		}
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- relay.Run(runCtx) }()
		defer func() { stop(); _ = relay.Close(); <-done }()
		var st outbox.Status
		deadline := time.Now().Add(20 * time.Second)
		for {
			if st, err = ob.Status(ctx); err != nil {
				t.Fatal(err)
			}
			// The final state: the refused row set aside, nothing else
			// pending (the good row's mark may commit a moment later).
			if st.SetAside == 1 && st.Pending == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		fwd, failed := relay.Counts()
		if st.SetAside != 1 || st.Pending != 0 || fwd != 1 || failed < 3 {
			t.Fatalf("status %+v, forwarded %d, failed publishes %d; want the refused row set aside after 3 failures and the good one forwarded", st, fwd, failed)
		}
		if n := count(topic); n != 1 {
			t.Errorf("%d rows in the topic's table, want the good message alone", n)
		}
	})

	t.Run("BYTEA column delivers the payload unchanged", func(t *testing.T) {
		topic, pub, sub := newPubSub(t, wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }})
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), malformed)); err != nil {
			t.Fatalf("publishing into a BYTEA column: %v", err)
		}
		// Minutes, not seconds: on a shared server other programs' open
		// transactions hold delivery back (TestWatermillSQLWaitsForOlderTransactions).
		subCtx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
		msgs, err := sub.Subscribe(subCtx, topic)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-msgs:
			if !bytes.Equal(m.Payload, malformed) {
				t.Errorf("payload %q, want %q", m.Payload, malformed)
			}
			m.Ack()
		case <-subCtx.Done():
			t.Fatal("the message was not delivered")
		}
	})
}

// watermill-sql's PostgreSQL subscriber reads only rows older than every
// transaction still open on the server (pg_snapshot_xmin): a transaction
// that has nothing to do with the topic, held open, holds back delivery of
// every row published after it began, until it ends.
func TestWatermillSQLWaitsForOlderTransactions(t *testing.T) {
	db := testenv.Postgres(t)
	ctx := t.Context()
	topic := "wsql_xmin_" + newRunID(time.Now())
	schema := wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db.DB), wsql.PublisherConfig{SchemaAdapter: schema}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		ConsumerGroup: "test", SchemaAdapter: schema, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		PollInterval: 10 * time.Millisecond,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = sub.Close()
		_ = pub.Close()
		for _, table := range []string{"watermill_" + topic, "watermill_offsets_" + topic} {
			_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`"`)
		}
	})
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	// An unrelated transaction with a transaction ID, left open.
	other, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	if _, err := other.ExecContext(ctx, "SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		t.Fatal("delivered while an older transaction was open")
	case <-time.After(time.Second):
	}
	if err := other.Rollback(); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
	case <-time.After(3 * time.Minute): // other programs' transactions may still be open
		t.Fatal("not delivered after the older transaction ended")
	}
}
