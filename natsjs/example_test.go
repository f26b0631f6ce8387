package natsjs_test

import (
	"fmt"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// A pipeline on NATS JetStream. The stream ORDERS must take "orders" and
// "orders.>" (the parking topics). It needs a running server, so the example
// is compiled, not run.
func ExampleNewSubscriber() {
	url := os.Getenv("NATS_URL")
	logger := watermill.NewStdLogger(false, false)

	pub, err := wmnats.NewPublisher(natsjs.NewPublisherConfig(url), logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	sub, err := natsjs.NewSubscriber(url, natsjs.Config{Durable: "billing", SubscribersCount: 4}, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: dedupe.NewMemoryStore()})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := p.Handle("bill", "orders", sub, func(msg *message.Message) error {
		// Runs once per order; a failure comes back after Config.NakDelay,
		// through JetStream, without holding this subscription meanwhile.
		return nil
	}); err != nil {
		log.Fatal(err)
	}
	// router.Run(ctx)
}

// A configuration that cannot hold settle's guarantees is refused before
// any connection is made.
func ExampleConfig() {
	_, err := natsjs.NewSubscriber("nats://127.0.0.1:4222", natsjs.Config{}, nil)
	fmt.Println(err)
	_, err = natsjs.NewSubscriber("nats://127.0.0.1:4222", natsjs.Config{Durable: "orders.billing"}, nil)
	fmt.Println(err)
	// Output:
	// natsjs: Config.Durable is required
	// natsjs: Config.Durable must hold only letters, digits, '-' and '_', got "orders.billing"
}
