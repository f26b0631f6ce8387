package middleware

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/park"
)

// DeadLetterConfig configures the dead-letter middleware.
type DeadLetterConfig struct {
	// Publisher publishes the dead-lettered copies. Required.
	Publisher message.Publisher
	// Topic receives the copies. Required.
	Topic string
	// NackDelay is how long to wait before nacking a message whose copy
	// could not be published. Defaults to 1s. Must be >= 0.
	NackDelay time.Duration
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *DeadLetterConfig) setDefaults() {
	park.Defaults(&c.NackDelay, &c.Logger)
}

// Validate reports the first invalid field.
func (c DeadLetterConfig) Validate() error {
	return park.Validate("middleware: DeadLetterConfig", c.Publisher, c.Topic, c.NackDelay)
}

// NewDeadLetter returns middleware that parks messages whose attempts are
// exhausted (an *ExhaustedError from the retry middleware inside it): a copy
// goes to the dead-letter topic with settle_outcome "dead_lettered", the last
// error as settle_reason, the original topic, handler and UUID, the attempt
// count and the first and last failure times, and then the original is acked.
// If the copy cannot be published the original is nacked, so nothing is lost.
// Other errors pass through unchanged.
func NewDeadLetter(cfg DeadLetterConfig) (message.HandlerMiddleware, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return park.Middleware(park.Config{
		Publisher: cfg.Publisher,
		Topic:     cfg.Topic,
		NackDelay: cfg.NackDelay,
		Logger:    cfg.Logger,
		Name:      "deadletter",
		Match: func(_ *message.Message, err error) (park.Info, bool) {
			var ex *ExhaustedError
			if !errors.As(err, &ex) {
				return park.Info{}, false
			}
			return park.Info{
				Outcome:      settle.DeadLettered,
				Reason:       ex.Err.Error(),
				Attempt:      ex.Attempts,
				FirstFailure: ex.FirstFailure,
				LastFailure:  ex.LastFailure,
			}, true
		},
	}), nil
}
