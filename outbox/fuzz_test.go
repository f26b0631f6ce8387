package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// Whatever bytes sit in an outbox row, the relay forwards the row (a valid
// envelope) or sets it aside on the poison topic, and never blocks the rows
// behind it: after Forward nothing is pending.
func FuzzRelayRow(f *testing.F) {
	f.Add([]byte(`{"destination_topic":"orders","uuid":"u-1","payload":"e30=","metadata":{"a":"b"}}`))
	f.Add([]byte(`{"destination_topic":"","uuid":"u-1"}`))
	f.Add([]byte(`{"destination_topic":"orders","payload":"not base64!"}`))
	f.Add([]byte(`{"destination_topic":"orders","metadata":{"a":1}}`))
	f.Add([]byte(`null`))
	f.Add([]byte("\xff\xfe"))
	f.Add([]byte(``))
	e := setup(f, testenv.SQLite(f))
	raw, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(e.db.DB), wsql.PublisherConfig{SchemaAdapter: outbox.SQLiteSchema{}}, nil)
	if err != nil {
		f.Fatal(err)
	}
	db := wsql.BeginnerFromStdSQL(e.db.DB)
	f.Fuzz(func(t *testing.T, payload []byte) {
		if err := raw.Publish(e.ob.Topic(), message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Skip("the row could not be written:", err)
		}
		if _, err := e.ob.Forward(t.Context(), db, e.pubsub, outbox.RelayConfig{PollInterval: 2 * time.Millisecond, RetryInterval: 5 * time.Millisecond}); err != nil {
			t.Fatalf("Forward with the row %q: %v", payload, err)
		}
		st, err := e.ob.Status(t.Context(), db, "")
		if err != nil || st.Pending != 0 {
			t.Fatalf("after Forward: %+v, %v; the row %q blocks the outbox", st, err, payload)
		}
	})
}
