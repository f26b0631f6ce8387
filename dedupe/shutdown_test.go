package dedupe_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// shutdownMidClaim is a real store whose Claim meets the router's shutdown:
// the message's context is cancelled while the claim is on its way, the
// claim commits on the server all the same, and the caller is told only of
// the cancellation, as a driver is when the cancel comes after the server
// wrote the row.
type shutdownMidClaim struct {
	dedupe.Store
	cancel context.CancelFunc
}

func (s shutdownMidClaim) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	s.cancel()
	c, err := s.Store.Claim(context.WithoutCancel(ctx), key, ttl)
	if ctx.Err() != nil {
		return dedupe.Claim{}, ctx.Err()
	}
	return c, err
}

// A shutdown that cancels a delivery while its key is being claimed must
// not leave the key claimed: the redelivery, after a restart, would find it
// busy and wait out the whole claim timeout (seen by following
// getting-started: 19 deferrals in 30 s after a Ctrl-C). The handler does
// not run, and the key is free at once.
func TestShutdownDuringClaimLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			mw, err := dedupe.NewMiddleware(dedupe.Config{Store: shutdownMidClaim{Store: store, cancel: cancel}, ClaimTimeout: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			ran := false
			msg := message.NewMessage("m-shutdown", nil)
			msg.SetContext(ctx)
			if _, err := mw(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })(msg); err == nil {
				t.Fatal("a delivery cancelled during its claim was settled; want it deferred")
			}
			if ran {
				t.Error("the handler ran for a delivery cancelled during its claim")
			}
			c, err := store.Claim(t.Context(), "m-shutdown", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if c.Result != dedupe.Acquired {
				t.Fatalf("after a shutdown during the claim, the redelivery's claim is %v; want acquired at once (the key was left claimed)", c.Result)
			}
		})
	}
}
