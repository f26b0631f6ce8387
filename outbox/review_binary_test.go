package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// review: a message's metadata values are strings of any bytes (a binary
// header from a producer, a hash); written through the outbox and
// forwarded, each must arrive as it was, and its payload too.
func TestReviewOutboxKeepsBinaryMetadata(t *testing.T) {
	t.Skip("review: the outbox stores metadata as JSON, which replaces every byte that is not UTF-8 with U+FFFD in keys and values, so a binary header arrives changed; not yet fixed")
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		m := message.NewMessage(watermill.NewUUID(), []byte("\xff\x00payload"))
		m.Metadata.Set("bin", "\xff\xfe\x00\x01 raw")
		m.Metadata.Set("\xc3\x28key", "v")
		e.publishTx(t, "orders", m)
		if _, err := e.ob.Forward(t.Context(), e.db.DB, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		select {
		case g := <-got:
			g.Ack()
			if string(g.Payload) != string(m.Payload) {
				t.Errorf("payload %q, want %q", g.Payload, m.Payload)
			}
			if v := g.Metadata.Get("bin"); v != "\xff\xfe\x00\x01 raw" {
				t.Errorf("metadata bin = %q, want %q", v, "\xff\xfe\x00\x01 raw")
			}
			if v, ok := g.Metadata["\xc3\x28key"]; !ok || v != "v" {
				t.Errorf("metadata key with invalid UTF-8 lost: %q", g.Metadata)
			}
		case <-time.After(30 * time.Second):
			st, _ := e.ob.Status(t.Context(), e.db.DB)
			t.Fatalf("not forwarded: %+v", st)
		}
	})
}
