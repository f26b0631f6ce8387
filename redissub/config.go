package redissub

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/redis/go-redis/v9"
)

// Settings of SubscriberConfig for watermill-redisstream's subscriber.
const (
	stockClaimInterval = time.Second
	stockMaxIdleTime   = 30 * time.Second
	// never is a ConsumerTimeout no consumer reaches: watermill-redisstream
	// then deletes no consumer.
	never = time.Duration(math.MaxInt64)
	// stockCheckConsumers is how often watermill-redisstream then lists
	// the consumers for nothing: once a day.
	stockCheckConsumers = 24 * time.Hour
	// minConsumerTimeout is the shortest ConsumerTimeout
	// CheckSubscriberConfig accepts.
	minConsumerTimeout = 365 * 24 * time.Hour
)

// SubscriberConfig returns a watermill-redisstream SubscriberConfig for the
// consumer group group, with the settings settle's guarantee needs on
// watermill-redisstream's own subscriber (see the package documentation):
//
//   - ConsumerGroup: consumers of a handler compete, and an entry stays
//     pending until acked, so a crashed consumer's entries are redelivered;
//   - MaxIdleTime 30s and ClaimInterval 1s: a dead consumer's entries are
//     redelivered 30 to 31 seconds after their delivery (60 to 65 with the
//     package's defaults); a delivery still running after 30s is delivered
//     to a second consumer as well, where settle's dedupe defers it until the
//     first one settles;
//   - ConsumerTimeout never reached (and CheckConsumersInterval a day): no
//     consumer is deleted. watermill-redisstream deletes a consumer that
//     XINFO CONSUMERS shows idle for ConsumerTimeout with nothing pending,
//     in a second command; a consumer that takes an entry between the two
//     loses it from the group's pending list (XGROUP DELCONSUMER drops the
//     entries a consumer holds), and if it then dies the message is never
//     delivered again. On Redis before 7.2 a live consumer of a quiet
//     stream does look idle: a read that returns nothing does not reset
//     its idle time (watermill-redisstream issue #24, and the test
//     TestIdleConsumerDeletion). A consumer that has gone stays listed in
//     the group, with nothing pending: a few bytes each;
//   - DisableIndefiniteInitialBlock: every read returns within BlockTime,
//     so that a subscriber of an empty stream notices Close at once;
//   - ShouldStopOnReadErrors stops the reader on a cancelled context or a
//     closed client, the errors Close causes: without it the reader sleeps
//     500ms after the failed read and only then returns, and Close does not
//     wait for it, so a goroutine outlives Close (a test checking for leaked
//     goroutines sees it). watermill-redisstream logs "stop reading after
//     error" at error level when it stops the reader this way.
//
// Set Unmarshaller or the other fields on the result as needed, and pass it
// through CheckSubscriberConfig if you change them.
func SubscriberConfig(client redis.UniversalClient, group string) redisstream.SubscriberConfig {
	return redisstream.SubscriberConfig{
		Client:                        client,
		ConsumerGroup:                 group,
		ClaimInterval:                 stockClaimInterval,
		MaxIdleTime:                   stockMaxIdleTime,
		ConsumerTimeout:               never,
		CheckConsumersInterval:        stockCheckConsumers,
		DisableIndefiniteInitialBlock: true,
		ShouldStopOnReadErrors:        closedByClose,
	}
}

// closedByClose reports whether err is one a read fails with once its
// subscriber is closed or its subscription's context cancelled.
func closedByClose(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, redis.ErrClosed)
}

// CheckSubscriberConfig reports, in an error wrapping ErrInvalidConfig, a
// watermill-redisstream SubscriberConfig under which settle cannot keep its
// guarantee: no client; no consumer group (fan-out reads with XREAD, which
// nothing acknowledges: a consumer killed during a handler loses the
// message); or consumers deleted when idle, a ConsumerTimeout below a year
// (0 is the package's 600s), which can drop an entry a live consumer has
// just taken (see SubscriberConfig).
func CheckSubscriberConfig(cfg redisstream.SubscriberConfig) error {
	switch {
	case cfg.Client == nil:
		return fmt.Errorf("%w: SubscriberConfig.Client is nil", ErrInvalidConfig)
	case cfg.ConsumerGroup == "":
		return fmt.Errorf("%w: SubscriberConfig.ConsumerGroup is empty: fan-out reads are never acknowledged, and a consumer killed during a handler loses its message", ErrInvalidConfig)
	case cfg.ConsumerTimeout < minConsumerTimeout:
		return fmt.Errorf("%w: SubscriberConfig.ConsumerTimeout %v (0 is 600s) deletes idle consumers, which can drop the entries a live consumer has just taken (watermill-redisstream issue #24); use SubscriberConfig's", ErrInvalidConfig, cfg.ConsumerTimeout)
	}
	return nil
}
