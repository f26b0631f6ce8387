package outbox_test

import (
	"database/sql"
	"encoding/json"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// rowScanner is one row of SQLiteSchema's SelectQuery: offset, uuid,
// payload, metadata.
type rowScanner struct {
	uuid, payload string
	metadata      sql.NullString
}

func (r rowScanner) Scan(dest ...any) error {
	if len(dest) != 4 {
		return errors.New("rowScanner: want 4 destinations")
	}
	*dest[0].(*int64) = 1
	*dest[1].(*[]byte) = []byte(r.uuid)
	*dest[2].(*[]byte) = []byte(r.payload)
	*dest[3].(*sql.NullString) = r.metadata
	return nil
}

// metadataColumn returns the metadata column SQLiteSchema writes for md
// (the same encoding as the outbox's publisher), and what it reads back.
func metadataColumn(t *testing.T, md message.Metadata) (string, message.Metadata) {
	t.Helper()
	schema := outbox.SQLiteSchema{}
	m := message.NewMessage("u", []byte("p"))
	m.Metadata = md
	q, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: "t", Msgs: message.Messages{m}})
	if err != nil {
		t.Fatal(err)
	}
	col, ok := q.Args[2].(string)
	if !ok {
		t.Fatalf("metadata argument %T, want a string", q.Args[2])
	}
	r, err := schema.UnmarshalMessage(wsql.UnmarshalMessageParams{Row: rowScanner{uuid: "u", payload: "p", metadata: sql.NullString{String: col, Valid: true}}})
	if err != nil {
		t.Fatalf("reading back the column %q: %v", col, err)
	}
	return col, r.Msg.Metadata
}

// Any metadata, of any bytes, round-trips byte for byte; metadata that is
// all valid UTF-8 is stored exactly as settle has always stored it (the
// JSON object of its strings), and the other form is ASCII.
func FuzzMetadataRoundTrip(f *testing.F) {
	for _, c := range metadataCases {
		var rest []byte
		for k, v := range c.md {
			rest = append(rest, byte(len(k)))
			rest = append(rest, k...)
			rest = append(rest, byte(len(v)))
			rest = append(rest, v...)
		}
		f.Add("k", "v", rest)
	}
	f.Add("\xff", "", []byte{})
	f.Add("", "\xff", []byte{1, 0xc0, 1, 0x80})
	f.Add("settle_metadata_base64", `{"YQ==":"Yg=="}`, []byte{1, 'a', 1, 0xff})
	f.Add("\xed\xa0\x80", "\xf4\x90\x80\x80", []byte{}) // a surrogate, a code point past U+10FFFF
	f.Add("\u2028", "<&>\x00", []byte{2, 0xc3, 0x28, 0})
	f.Fuzz(func(t *testing.T, k, v string, rest []byte) {
		md := message.Metadata{k: v}
		for len(rest) > 0 {
			n := min(int(rest[0]), len(rest)-1)
			key := string(rest[1 : 1+n])
			rest = rest[1+n:]
			var val string
			if len(rest) > 0 {
				n = min(int(rest[0]), len(rest)-1)
				val = string(rest[1 : 1+n])
				rest = rest[1+n:]
			}
			md[key] = val
		}
		col, got := metadataColumn(t, maps.Clone(md))
		if !maps.Equal(got, md) {
			t.Fatalf("metadata %q came back as %q (column %q)", md, got, col)
		}
		valid := true
		for k, v := range md {
			valid = valid && utf8.ValidString(k) && utf8.ValidString(v)
		}
		if valid {
			want, _ := json.Marshal(md)
			if col != string(want) {
				t.Fatalf("metadata %q (all UTF-8) stored as %q, want %q as before", md, col, want)
			}
		} else if strings.ContainsFunc(col, func(r rune) bool { return r >= 0x80 }) || !strings.HasPrefix(col, `{"settle_metadata_base64":{`) {
			t.Fatalf("metadata %q stored as %q, want the base64 form", md, col)
		}
	})
}

// No metadata at all (a nil map) is stored as before ("null") and read as
// empty, usable metadata.
func TestMetadataNil(t *testing.T) {
	t.Parallel()
	col, got := metadataColumn(t, nil)
	if col != "null" || got == nil || len(got) != 0 {
		t.Fatalf("nil metadata: column %q, read back %q; want null and an empty map", col, got)
	}
}

// A metadata column in neither form is refused by SQLiteSchema with an
// error naming the message and saying what was wrong.
func TestSQLiteSchemaRefusesBadMetadataForm(t *testing.T) {
	t.Parallel()
	for _, col := range []string{
		`{"settle_metadata_base64":{"!!":"YQ=="}}`,
		`{"settle_metadata_base64":{"YQ==":"YQ"}}`,
		`{"settle_metadata_base64":{"YQ==":"Yg=="},"x":"y"}`,
		`[]`,
	} {
		_, err := outbox.SQLiteSchema{}.UnmarshalMessage(wsql.UnmarshalMessageParams{Row: rowScanner{uuid: "m-1", metadata: sql.NullString{String: col, Valid: true}}})
		if err == nil || !strings.Contains(err.Error(), "metadata of message m-1") || !strings.Contains(err.Error(), "neither a JSON object of strings nor settle's base64 form") {
			t.Errorf("column %q: %v; want an error naming the message and the two forms", col, err)
		}
	}
}

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

// SQLiteSchema, the watermill-sql adapter, writes and reads the same
// forms: every case arrives byte for byte through watermill-sql's
// publisher and subscriber on SQLite.
func TestSQLiteSchemaKeepsBinaryMetadata(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, true)
	pub, sub := newSQLitePubSub(t, db, "")
	const topic = "binary.metadata"
	initTopic(t, sub, topic)
	msgs, err := sub.Subscribe(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	sent, cases := newMetadataMessages()
	if err := pub.Publish(topic, sent...); err != nil {
		t.Fatal(err)
	}
	checkMetadataColumns(t, func(uuid string) string {
		var col string
		if err := db.QueryRowContext(t.Context(), `SELECT "metadata" FROM "watermill_`+topic+`" WHERE "uuid" = ?`, uuid).Scan(&col); err != nil {
			t.Fatal(err)
		}
		return col
	}, sent, cases)
	checkForwardedMetadata(t, msgs, sent, cases, func() string { return "" })
}
