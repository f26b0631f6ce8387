package dedupe

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/deliverymark"
	"github.com/settle-go/settle/internal/settlement"
)

// ErrUnavailable is wrapped by the error of a delivery that was deferred
// because the store could not answer its claim: the delivery is nacked after
// a delay, and no attempt is counted for it.
var ErrUnavailable = errors.New("dedupe: store unavailable; delivery deferred")

// ErrAttemptsUsedUp is wrapped by the error of a delivery whose key has been
// acquired as many times as the attempt limit allows (the retry
// middleware's MaxAttempts, read from the delivery's settlement): the handler
// is not started again, and the retry middleware hands the message to the
// dead-letter parking. Earlier attempts never finished; typically the
// consumer died during each of them.
var ErrAttemptsUsedUp = errors.New("dedupe: attempts used up; handler not started again")

// deferral holds what the middleware knows of the store's health: how many
// claims in a row it could not answer, which grows the delay before their
// deliveries are nacked.
type deferral struct {
	failures atomic.Int64
	log      *settlement.RateLog
}

func newDeferral(log watermill.LoggerAdapter) *deferral {
	return &deferral{log: settlement.NewRateLog(log, 5*time.Second)}
}

// unavailableDelay returns the wait before nacking after n failed claims in a row:
// UnavailableDelay doubling up to MaxUnavailableDelay.
func (c Config) unavailableDelay(n int64) time.Duration {
	d := c.UnavailableDelay
	for i := int64(1); i < n && d > 0 && d < c.MaxUnavailableDelay; i++ {
		d *= 2
	}
	return min(d, c.MaxUnavailableDelay)
}

// claimed is called after every claim the store answered.
func (d *deferral) claimed() {
	if d.failures.Load() != 0 {
		d.failures.Store(0)
	}
}

// unavailable defers a delivery whose claim the store could not answer: not
// an attempt, nacked after a delay that grows while the store stays
// unavailable, logged at a rate a person can read.
func (m *mw) unavailable(msg *message.Message, ctx context.Context, err error) error {
	settlement.FromContext(ctx).Defer()
	if ctx.Err() != nil { // shutting down: the store did not fail
		return fmt.Errorf("dedupe: claim for message %s: %w", msg.UUID, err)
	}
	n := m.health.failures.Add(1)
	wait := m.cfg.unavailableDelay(n)
	m.health.log.Error("dedupe: store cannot answer; deliveries deferred, not counted as attempts", err, watermill.LogFields{
		"message_uuid": msg.UUID, "failed_claims_in_a_row": n, "nack_delay": wait.String(),
	})
	// A broker that holds the nack itself (natsjs) waits in its place.
	settlement.Sleep(ctx, wait-deliverymark.NakDelay(msg))
	return fmt.Errorf("%w: claim for message %s: %w", ErrUnavailable, msg.UUID, err)
}

// busy defers a delivery whose key another worker holds: not an attempt,
// nacked after BusyDelay so that it does not spin (sooner by the delay the
// broker holds a nack for, when the delivery is marked with one).
func (m *mw) busy(msg *message.Message, ctx context.Context) error {
	settlement.FromContext(ctx).Defer()
	settlement.Sleep(ctx, m.cfg.BusyDelay-deliverymark.NakDelay(msg))
	return fmt.Errorf("%w (message %s)", ErrBusy, msg.UUID)
}
