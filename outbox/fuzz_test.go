package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/outbox"
)

// Whatever metadata text sits in an outbox row, the relay forwards the row
// (a JSON object of strings) or sets it aside on the poison topic, and never
// blocks the rows behind it: after Forward nothing is pending.
func FuzzRelayRow(f *testing.F) {
	f.Add(`{"a":"b"}`)
	f.Add(`{}`)
	f.Add(`{"a":1}`)
	f.Add(`null`)
	f.Add("\xff\xfe")
	f.Add(``)
	e := setup(f, sqliteDrv)
	f.Fuzz(func(t *testing.T, metadata string) {
		e.rawInsert(t, watermill.NewUUID(), "orders", []byte("x"), metadata)
		if _, err := e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 2 * time.Millisecond, RetryInterval: 5 * time.Millisecond}); err != nil {
			t.Fatalf("Forward with the metadata %q: %v", metadata, err)
		}
		st, err := e.ob.Status(t.Context())
		if err != nil || st.Pending != 0 {
			t.Fatalf("after Forward: %+v, %v; the metadata %q blocks the outbox", st, err, metadata)
		}
	})
}
