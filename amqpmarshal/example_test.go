package amqpmarshal_test

import (
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
)

// A subscriber on a RabbitMQ quorum queue whose messages may carry headers of
// any type. It needs a running broker, so the example is compiled, not run.
func ExampleMarshaler() {
	marshaler, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		log.Fatal(err)
	}

	cfg := amqp.NewDurableQueueConfig(os.Getenv("AMQP_URL"))
	cfg.Marshaler = marshaler
	cfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}

	sub, err := amqp.NewSubscriber(cfg, watermill.NewStdLogger(false, false))
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()

	// Use sub in a message.Router. Every delivery reaches the router's
	// middleware; settle.MetaDeliveryCount and settle.MetaRedelivered are in
	// each message's metadata.
}
