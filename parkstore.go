package settle

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Parked is one message a parking middleware parks (dead-lettered or
// poisoned), as it is handed to a ParkStore before the original is acked.
type Parked struct {
	// Message is the original message, whole: its UUID, payload and
	// metadata as the handler received them (not the bounded copy
	// published to the parking topic).
	Message *message.Message
	// Outcome is DeadLettered or Poisoned.
	Outcome Outcome
	// Cause is the error that parked the message: the last failure of a
	// dead-lettered message, the permanent error of a poisoned one.
	Cause error
	// Handler is the name of the handler that failed; Topic the topic it
	// consumes.
	Handler, Topic string
	// Key is the dedupe key of the message for Handler when a dedupe
	// middleware ran inside the parking middleware, else "".
	Key string
	// Attempts is the number of runs of Handler on the message (0 when
	// unknown).
	Attempts int
	// FirstFailure is the time of the first failed run (zero when
	// unknown); LastFailure the time of the run that parked it.
	FirstFailure, LastFailure time.Time
	// TraceID is the hex trace id of the delivery's trace, "" when it was
	// not traced.
	TraceID string
}

// ParkStore records parked messages somewhere a person can find them: a
// table in the application's database (package parked). The parking
// middlewares call Park before the original is acked; an error from it
// defers the delivery (nacked, not an attempt), so Park must return nil only
// once the record is durable. Park must be idempotent for one message and
// handler: a delivery deferred after Park succeeded (its parking topic
// refused the copy) is parked again on redelivery.
type ParkStore interface {
	Park(ctx context.Context, p Parked) error
}
