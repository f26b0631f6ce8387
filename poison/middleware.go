package poison

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/park"
)

// Config configures the poison middleware.
type Config struct {
	// Publisher publishes the poisoned copies. Required. It may be the
	// publisher of the dead-letter middleware.
	Publisher message.Publisher
	// Topic receives the poisoned copies. Required. It may equal the
	// dead-letter topic; settle_outcome tells the two kinds apart.
	Topic string
	// IsPermanent decides which errors poison a message. Defaults to
	// IsPermanent: errors marked with Permanent, decode errors, dedupe key
	// errors and anything else with a Permanent() bool method returning true.
	IsPermanent func(error) bool
	// NackDelay is how long to wait before nacking a message whose poisoned
	// copy could not be published, so that an unreachable topic does not turn
	// into a hot redelivery loop. Defaults to 1s. Must be >= 0.
	NackDelay time.Duration
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.IsPermanent == nil {
		c.IsPermanent = IsPermanent
	}
	park.Defaults(&c.NackDelay, &c.Logger)
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	return park.Validate("poison: Config", c.Publisher, c.Topic, c.NackDelay)
}

// NewMiddleware returns middleware that parks messages failing with a
// permanent error: a copy goes to the poison topic with the reason, original
// topic, handler, UUID and failure times in its metadata (the settle.Meta*
// keys, settle_outcome = "poisoned"), and the original is acked. If the copy
// cannot be published, the original is nacked: nothing is acked that is not
// stored somewhere a person can find it.
//
// Place it outside the retry middleware, which returns permanent errors at
// once instead of retrying them.
func NewMiddleware(cfg Config) (message.HandlerMiddleware, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return park.Middleware(park.Config{
		Publisher: cfg.Publisher,
		Topic:     cfg.Topic,
		NackDelay: cfg.NackDelay,
		Logger:    cfg.Logger,
		Name:      "poison",
		Match: func(msg *message.Message, err error) (park.Info, bool) {
			if !cfg.IsPermanent(err) {
				return park.Info{}, false
			}
			return park.Info{Outcome: settle.Poisoned, Reason: err.Error(), Attempt: attemptOf(msg)}, true
		},
	}), nil
}

// attemptOf reads the attempt recorded by the retry middleware, if any.
func attemptOf(msg *message.Message) int {
	var n int
	_, _ = fmt.Sscan(msg.Metadata.Get(settle.MetaAttempt), &n)
	return n
}
