package pipeline_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
)

type OrderPlaced struct {
	ID    string `json:"id"`
	Cents int    `json:"cents"`
}

// A typed handler behind the whole stack: a duplicate is absorbed, and a
// payload that is not an OrderPlaced goes to the poison topic.
func Example() {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})

	p, err := pipeline.New(router, pipeline.Config{
		Publisher:      pubsub,
		Store:          dedupe.NewMemoryStore(),
		DisableTracing: true,
	})
	if err != nil {
		panic(err)
	}
	charged := make(chan string, 10)
	_, err = p.Handle("charge", "orders", pubsub, pipeline.Typed(nil, func(ctx context.Context, m pipeline.Message[OrderPlaced]) error {
		charged <- fmt.Sprintf("charged %s: %d cents", m.Body.ID, m.Body.Cents)
		return nil
	}))
	if err != nil {
		panic(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	defer router.Close()
	<-router.Running()

	msg, _ := pipeline.NewMessage("m-1", nil, OrderPlaced{ID: "A-17", Cents: 1999})
	_ = pubsub.Publish("orders", msg, msg.Copy()) // delivered twice
	_ = pubsub.Publish("orders", message.NewMessage("m-2", []byte(`{"id": 17}`)))

	poisoned, _ := pubsub.Subscribe(context.Background(), "orders.poison")
	fmt.Println(<-charged)
	p2 := <-poisoned
	p2.Ack()
	fmt.Println("poisoned:", p2.UUID)
	// Output:
	// charged A-17: 1999 cents
	// poisoned: m-2
}
