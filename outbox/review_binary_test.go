package outbox_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// metadataCase is one message's metadata for the binary-metadata tests;
// plain says that the outbox column must hold it as it always has: the JSON
// object of its strings.
type metadataCase struct {
	name  string
	md    map[string]string
	plain bool
}

var metadataCases = []metadataCase{
	// The reviewer's message.
	{"binary value and invalid key", map[string]string{"bin": "\xff\xfe\x00\x01 raw", "\xc3\x28key": "v"}, false},
	{"nul", map[string]string{"nul": "a\x00b", "\x00k": "\x00"}, true},
	{"plain header", map[string]string{"content_type": "application/json", "é": "ü <&> \u2028 🙂", "empty": ""}, true},
	{"reserved key used by a user", map[string]string{"settle_metadata_base64": `{"YQ==":"Yg=="}`, "x": "y"}, true},
	{"reserved key used by a user, with a binary header", map[string]string{"settle_metadata_base64": "\xff", "x": "y\x80"}, false},
	{"a value that is the base64 form", map[string]string{"a": `{"settle_metadata_base64":{"YQ==":"Yg=="}}`}, true},
	{"only a binary key", map[string]string{"\xed\xa0\x80": ""}, false},
	{"none", map[string]string{}, true},
}

// newMetadataMessages returns one message per metadataCase, its payload
// binary too, and the case of each UUID.
func newMetadataMessages() ([]*message.Message, map[string]metadataCase) {
	msgs := make([]*message.Message, 0, len(metadataCases))
	byUUID := map[string]metadataCase{}
	for _, c := range metadataCases {
		m := message.NewMessage(watermill.NewUUID(), []byte("\xff\x00payload "+c.name))
		for k, v := range c.md {
			m.Metadata.Set(k, v)
		}
		msgs = append(msgs, m)
		byUUID[m.UUID] = c
	}
	return msgs, byUUID
}

// withoutTrace is md less the trace context the outbox writes.
func withoutTrace(md message.Metadata) map[string]string {
	out := maps.Clone(map[string]string(md))
	delete(out, "traceparent")
	delete(out, "tracestate")
	return out
}

// checkMetadataColumns asserts what the outbox table holds: each plain
// case's metadata exactly as settle has always written it (json.Marshal of
// the metadata the publisher saw), every other case in the base64 form,
// which is ASCII.
func checkMetadataColumns(t *testing.T, column func(uuid string) string, sent []*message.Message, cases map[string]metadataCase) {
	t.Helper()
	for _, m := range sent {
		c := cases[m.UUID]
		col := column(m.UUID)
		if c.plain {
			want, err := json.Marshal(m.Metadata)
			if err != nil {
				t.Fatal(err)
			}
			if col != string(want) {
				t.Errorf("%s: metadata column %q, want %q (the plain form, unchanged)", c.name, col, want)
			}
			continue
		}
		if !strings.HasPrefix(col, `{"settle_metadata_base64":{`) || strings.ContainsFunc(col, func(r rune) bool { return r >= 0x80 }) {
			t.Errorf("%s: metadata column %q, want the base64 form", c.name, col)
		}
	}
}

// checkForwardedMetadata receives len(sent) messages from got and asserts
// that each arrived with its payload and metadata byte for byte.
func checkForwardedMetadata(t *testing.T, got <-chan *message.Message, sent []*message.Message, cases map[string]metadataCase, status func() string) {
	t.Helper()
	want := map[string]*message.Message{}
	for _, m := range sent {
		want[m.UUID] = m
	}
	deadline := time.After(30 * time.Second)
	for range sent {
		select {
		case g := <-got:
			g.Ack()
			m, ok := want[g.UUID]
			if !ok {
				t.Errorf("forwarded %s: not sent, or forwarded twice", g.UUID)
				continue
			}
			delete(want, g.UUID)
			c := cases[g.UUID]
			if string(g.Payload) != string(m.Payload) {
				t.Errorf("%s: payload %q, want %q", c.name, g.Payload, m.Payload)
			}
			if gm := withoutTrace(g.Metadata); !maps.Equal(gm, c.md) {
				t.Errorf("%s: metadata %q, want %q", c.name, gm, c.md)
			}
		case <-deadline:
			t.Fatalf("%d of %d message(s) not forwarded within 30s: %s", len(want), len(sent), status())
		}
	}
}

// review: a message's metadata values are strings of any bytes (a binary
// header from a producer, a hash); written through the outbox and
// forwarded, each must arrive as it was, and its payload too.
func TestReviewOutboxKeepsBinaryMetadata(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		sent, cases := newMetadataMessages()
		e.publishTx(t, "orders", sent...)
		checkMetadataColumns(t, func(uuid string) string {
			var col string
			q := "SELECT metadata FROM " + quoteTable(e, e.ob.Table()) + " WHERE uuid = " + e.ph(1)
			if err := e.db.QueryRowContext(t.Context(), q, uuid).Scan(&col); err != nil {
				t.Fatal(err)
			}
			return col
		}, sent, cases)
		if _, err := e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		checkForwardedMetadata(t, got, sent, cases, func() string {
			st, err := e.ob.Status(t.Context())
			return fmt.Sprintf("status %+v, %v", st, err)
		})
	})
}
