package redissub_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/redissub"
)

// The settings of watermill-redisstream's subscriber that settle needs, and
// the check that refuses its package defaults.
func ExampleSubscriberConfig() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}) // dials on first use
	defer client.Close()

	cfg := redissub.SubscriberConfig(client, "orders")
	fmt.Println("MaxIdleTime:", cfg.MaxIdleTime, "ClaimInterval:", cfg.ClaimInterval)
	fmt.Println("check:", redissub.CheckSubscriberConfig(cfg))
	// Its subscriber is then made as usual:
	// sub, err := redisstream.NewSubscriber(cfg, logger)

	defaults := redisstream.SubscriberConfig{Client: client, ConsumerGroup: "orders"}
	fmt.Println("defaults refused:", redissub.CheckSubscriberConfig(defaults) != nil)
	// Output:
	// MaxIdleTime: 30s ClaimInterval: 1s
	// check: <nil>
	// defaults refused: true
}

// settle's own subscriber: the delivery count from Redis, and 16 entries of
// one subscription in flight.
func ExampleNewSubscriber() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()

	sub, err := redissub.NewSubscriber(redissub.Config{
		Client:        client,
		ConsumerGroup: "orders",
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	fmt.Println("in flight:", sub.InFlight())

	_, err = redissub.NewSubscriber(redissub.Config{Client: client}, nil)
	fmt.Println(err)
	// Output:
	// in flight: 16
	// redissub: invalid config: Config.ConsumerGroup is empty; without a group a crashed consumer's entries are never redelivered
}
