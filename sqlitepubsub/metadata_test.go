package sqlitepubsub_test

import (
	"database/sql"
	"encoding/json"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/sqlitepubsub"
)

// rowScanner is one row of the schema's SelectQuery: offset, uuid,
// payload, metadata.
type rowScanner struct {
	uuid     string
	metadata sql.NullString
}

func (r rowScanner) Scan(dest ...any) error {
	if len(dest) != 4 {
		return errors.New("rowScanner: want 4 destinations")
	}
	*dest[0].(*int64) = 1
	*dest[1].(*[]byte) = []byte(r.uuid)
	*dest[2].(*[]byte) = []byte("p")
	*dest[3].(*sql.NullString) = r.metadata
	return nil
}

// A metadata column in neither form is refused with an error naming the
// message and saying what was wrong.
func TestRefusesBadMetadataForm(t *testing.T) {
	t.Parallel()
	schema := newSchema(t, sqlitepubsub.Config{})
	for _, col := range []string{
		`{"settle_metadata_base64":{"!!":"YQ=="}}`,
		`{"settle_metadata_base64":{"YQ==":"YQ"}}`,
		`{"settle_metadata_base64":{"YQ==":"Yg=="},"x":"y"}`,
		`[]`,
	} {
		_, err := schema.UnmarshalMessage(wsql.UnmarshalMessageParams{Row: rowScanner{uuid: "m-1", metadata: sql.NullString{String: col, Valid: true}}})
		if err == nil || !strings.Contains(err.Error(), "metadata of message m-1") || !strings.Contains(err.Error(), "neither a JSON object of strings nor settle's base64 form") {
			t.Errorf("column %q: %v; want an error naming the message and the two forms", col, err)
		}
	}
}

// Metadata of any bytes arrives byte for byte through watermill-sql's
// publisher and subscriber; metadata that is all valid UTF-8 is stored as
// the JSON object of its strings, the rest in the base64 form, as settle's
// outbox table stores it.
func TestKeepsBinaryMetadata(t *testing.T) {
	t.Parallel()
	cases := []struct {
		md    map[string]string
		plain bool
	}{
		{map[string]string{"bin": "\xff\xfe\x00\x01 raw", "\xc3\x28key": "v"}, false},
		{map[string]string{"nul": "a\x00b", "\x00k": "\x00"}, true},
		{map[string]string{"content_type": "application/json", "é": "ü <&> \u2028 🙂", "empty": ""}, true},
		{map[string]string{"settle_metadata_base64": `{"YQ==":"Yg=="}`, "x": "y"}, true},
		{map[string]string{"settle_metadata_base64": "\xff", "x": "y\x80"}, false},
		{map[string]string{"\xed\xa0\x80": ""}, false},
		{map[string]string{}, true},
	}
	db := openSQLite(t, true)
	pub, sub := newPubSub(t, db, "")
	const topic = "binary.metadata"
	initTopic(t, sub, topic)
	msgs, err := sub.Subscribe(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	sent := make([]*message.Message, len(cases))
	for i, c := range cases {
		sent[i] = message.NewMessage(watermill.NewUUID(), []byte("\xff\x00payload"))
		maps.Copy(sent[i].Metadata, c.md)
	}
	if err := pub.Publish(topic, sent...); err != nil {
		t.Fatal(err)
	}
	for i, c := range cases {
		var col string
		if err := db.QueryRowContext(t.Context(), `SELECT "metadata" FROM `+messagesTable(topic)+` WHERE "uuid" = ?`, sent[i].UUID).Scan(&col); err != nil {
			t.Fatal(err)
		}
		if c.plain {
			if want, _ := json.Marshal(c.md); col != string(want) {
				t.Errorf("case %d: metadata column %q, want %q", i, col, want)
			}
		} else if !strings.HasPrefix(col, `{"settle_metadata_base64":{`) || strings.ContainsFunc(col, func(r rune) bool { return r >= 0x80 }) {
			t.Errorf("case %d: metadata column %q, want the base64 form", i, col)
		}
	}
	for i, c := range cases {
		select {
		case got := <-msgs:
			got.Ack()
			if got.UUID != sent[i].UUID || string(got.Payload) != string(sent[i].Payload) || !maps.Equal(got.Metadata, c.md) {
				t.Errorf("case %d: got %s %q %q, want %s %q %q", i, got.UUID, got.Payload, got.Metadata, sent[i].UUID, sent[i].Payload, c.md)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("case %d: no message within 10s", i)
		}
	}
}
