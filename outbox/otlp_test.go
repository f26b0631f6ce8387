package outbox_test

import (
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/otlptest"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// A message ID that is not valid UTF-8 (SQLite stores it as it is) must not
// cost the outbox spans of the messages exported with it: the create and
// send spans go through otlptracehttp to a real OTLP/HTTP endpoint, and
// every message's spans arrive, the bad ID cleaned.
func TestOutboxSpansInvalidUTF8ReachOTLP(t *testing.T) {
	t.Parallel()
	recv := otlptest.New(t)
	tp := recv.TracerProvider(t)
	db := testenv.SQLite(t)
	ob, err := outbox.New(sqldb.Std(db.DB, sqldb.SQLite), outbox.Config{Tracing: []settle.Option{settle.WithTracerProvider(tp)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	placed, err := pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}

	bad := "order-\xff-" + strings.Repeat("y", 1000)
	var msgs []*message.Message
	for i := range 40 {
		msgs = append(msgs, message.NewMessage(fmt.Sprintf("order-%02d", i), []byte("{}")))
		if i == 20 {
			msgs = append(msgs, message.NewMessage(bad, []byte("{}")))
		}
	}
	tx, err := db.BeginTx(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ob.TxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("orders.placed", msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}

	r, err := ob.NewRelay(pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(t.Context()) }()
	<-r.Running()
	if err := r.Drain(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for range msgs {
		select {
		case m := <-placed:
			m.Ack()
		case <-time.After(10 * time.Second):
			t.Fatal("not every message was forwarded")
		}
	}

	want := 2 * len(msgs) // a create and a send span each
	var flushErr error
	deadline := time.Now().Add(30 * time.Second)
	for len(recv.Spans()) < want && time.Now().Before(deadline) {
		if err := tp.ForceFlush(t.Context()); err != nil {
			flushErr = err
		}
		time.Sleep(20 * time.Millisecond)
	}
	spans := recv.Spans()
	if len(spans) < want {
		t.Fatalf("the OTLP endpoint received %d spans in %d requests, want %d: one bad message lost the spans exported with it (exporter: %v)",
			len(spans), recv.Requests(), want, flushErr)
	}
	seen := map[string]int{}
	for _, sp := range spans {
		id, _ := otlptest.Attr(sp, "messaging.message.id")
		if !utf8.ValidString(id) || len(id) > 256 {
			t.Errorf("span %q: messaging.message.id of %d bytes, valid UTF-8 %v", sp.GetName(), len(id), utf8.ValidString(id))
		}
		seen[id]++
	}
	for _, m := range msgs {
		id := m.UUID
		if id == bad {
			id = ""
			for k := range seen {
				if strings.HasPrefix(k, "order-\uFFFD-yyy") && strings.HasSuffix(k, "…") {
					id = k
				}
			}
		}
		if seen[id] != 2 {
			t.Errorf("message %.20q: %d spans received, want a create and a send span", m.UUID, seen[id])
		}
	}
}
