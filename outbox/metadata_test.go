package outbox_test

import (
	"encoding/json"
	"maps"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/outbox"
)

// Rows already in an outbox table, written by an older settle or by hand,
// are read as they always were: a JSON object of strings (or null) is
// forwarded with exactly the metadata encoding/json reads from it, a
// user's own settle_metadata_base64 entry included; anything else goes to
// the poison topic unchanged, as before. A row in the base64 form is
// forwarded with its bytes; one that only looks like it is poison.
func TestMetadataRowsDecodeAsBefore(t *testing.T) {
	t.Parallel()
	type row struct {
		metadata string
		want     map[string]string // nil: poisoned
	}
	old := func(s string) map[string]string {
		var md map[string]string
		if err := json.Unmarshal([]byte(s), &md); err != nil {
			return nil
		}
		if md == nil {
			md = map[string]string{}
		}
		return md
	}
	rows := []row{
		{`{"a":"b","c":"\u0000\ufffd"}`, old(`{"a":"b","c":"\u0000\ufffd"}`)},
		{`null`, old(`null`)},
		{`{}`, old(`{}`)},
		{`{"a":null,"b":"x","b":"y"}`, old(`{"a":null,"b":"x","b":"y"}`)},
		{`{"settle_metadata_base64":"YQ=="}`, old(`{"settle_metadata_base64":"YQ=="}`)},
		{`{"settle_metadata_base64":null}`, old(`{"settle_metadata_base64":null}`)},
		{`{"settle_metadata_base64":{"YQ==":"/wA="}}`, map[string]string{"a": "\xff\x00"}},
		{`{"settle_metadata_base64":{}}`, map[string]string{}},
		{`{"settle_metadata_base64":{"YQ==":"Yg=="},"x":"y"}`, nil},
		{`{"settle_metadata_base64":{"YQ==":1}}`, nil},
		{`{"settle_metadata_base64":["YQ=="]}`, nil},
		{`{"Settle_metadata_base64":{"YQ==":"Yg=="}}`, nil},
		{`{"settle_metadata_base64":{"YQ":"Yg=="}}`, nil},
		{`{"settle_metadata_base64":{"YQ==":"not base64"}}`, nil},
		{`{"a":1}`, nil},
		{``, nil},
	}
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		poisoned, err := e.pubsub.Subscribe(t.Context(), e.ob.Topic()+"_poison")
		if err != nil {
			t.Fatal(err)
		}
		byUUID := map[string]row{}
		for _, r := range rows {
			id := watermill.NewUUID()
			byUUID[id] = r
			e.rawInsert(t, id, "orders", []byte("payload"), r.metadata)
		}
		if _, err := e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		deadline := time.After(30 * time.Second)
		for range rows {
			select {
			case m := <-got:
				r, ok := byUUID[m.UUID]
				delete(byUUID, m.UUID)
				if !ok || r.want == nil {
					t.Errorf("row %s with metadata %q forwarded (%q), want it poisoned", m.UUID, r.metadata, m.Metadata)
				} else if md := withoutTrace(m.Metadata); !maps.Equal(md, r.want) {
					t.Errorf("row with metadata %q forwarded with %q, want %q", r.metadata, md, r.want)
				}
			case m := <-poisoned:
				r, ok := byUUID[m.UUID]
				delete(byUUID, m.UUID)
				if !ok || r.want != nil {
					t.Errorf("row %s with metadata %q poisoned, want it forwarded with %q", m.UUID, r.metadata, r.want)
				} else if m.Metadata.Get("settle_outbox_metadata") != r.metadata || m.Metadata.Get("settle_outbox_topic") != "orders" {
					t.Errorf("poisoned row %q: copy's metadata %q", r.metadata, m.Metadata)
				}
			case <-deadline:
				t.Fatalf("rows not forwarded nor poisoned within 30s: %q", byUUID)
			}
		}
	})
}
