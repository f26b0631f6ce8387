package dedupe_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// review: a StoreTimeout no database can answer within (1ns, 1µs) is
// accepted, and then every delivery is deferred for ever: each claim ends
// at its deadline before the query is sent, the handler never runs, and
// nothing says why but a stream of "store unavailable" deferrals. Such a
// value must be refused by name, or work.
func TestReviewTinyStoreTimeout(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []time.Duration{time.Nanosecond, time.Microsecond} {
		mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, StoreTimeout: d, UnavailableDelay: settle.NoDelay})
		if err != nil {
			if !strings.Contains(err.Error(), "StoreTimeout") {
				t.Errorf("StoreTimeout %v refused without naming it: %v", d, err)
			}
			continue
		}
		runs := 0
		h := mw(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.SetContext(t.Context())
		var lastErr error
		for range 5 {
			if _, lastErr = h(msg); lastErr == nil {
				break
			}
		}
		if runs != 1 {
			t.Errorf("StoreTimeout %v accepted, and the handler ran %d times in 5 deliveries (last: %v)", d, runs, lastErr)
		}
	}
}
