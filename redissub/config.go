package redissub

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/redis/go-redis/v9"
)

// Settings of SubscriberConfig for watermill-redisstream's subscriber.
const (
	stockClaimInterval = time.Second
	stockMaxIdleTime   = 30 * time.Second
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
//   - DisableIndefiniteInitialBlock: a live consumer on an idle stream reads
//     again every BlockTime instead of blocking for good on its first read,
//     so it never looks idle to another consumer's check of idle consumers,
//     which deletes it, and the pending entries it took meanwhile
//     (watermill-redisstream issue #24);
//   - Consumer left empty: a random name per subscriber, never used again
//     once that subscriber has gone, so a deleted consumer cannot come back
//     and take entries that its deletion drops.
//
// Set Unmarshaller or the other fields on the result as needed, and pass it
// through CheckSubscriberConfig if you change them.
func SubscriberConfig(client redis.UniversalClient, group string) redisstream.SubscriberConfig {
	return redisstream.SubscriberConfig{
		Client:                        client,
		ConsumerGroup:                 group,
		ClaimInterval:                 stockClaimInterval,
		MaxIdleTime:                   stockMaxIdleTime,
		DisableIndefiniteInitialBlock: true,
	}
}

// CheckSubscriberConfig reports, in an error wrapping ErrInvalidConfig, a
// watermill-redisstream SubscriberConfig under which settle cannot keep its
// guarantee: no consumer group (fan-out reads with XREAD, which nothing
// acknowledges: a consumer killed during a handler loses the message), or
// an initial read that blocks for good (a live consumer can be deleted with
// the entries it holds, issue #24). Zero durations are read as the
// package's defaults.
func CheckSubscriberConfig(cfg redisstream.SubscriberConfig) error {
	switch {
	case cfg.Client == nil:
		return fmt.Errorf("%w: SubscriberConfig.Client is nil", ErrInvalidConfig)
	case cfg.ConsumerGroup == "":
		return fmt.Errorf("%w: SubscriberConfig.ConsumerGroup is empty: fan-out reads are never acknowledged, and a consumer killed during a handler loses its message", ErrInvalidConfig)
	case !cfg.DisableIndefiniteInitialBlock:
		return fmt.Errorf("%w: SubscriberConfig.DisableIndefiniteInitialBlock is false: a consumer blocked on its first read looks idle and can be deleted with the entries it takes (watermill-redisstream issue #24)", ErrInvalidConfig)
	}
	return nil
}
