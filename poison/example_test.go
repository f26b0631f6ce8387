package poison_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// A handler marks what no retry can fix; the poison parking middleware parks
// it on the poison topic, with the reason, and acks the original.
func ExamplePermanent() {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()

	mw, err := middleware.NewPoison(middleware.ParkConfig{Publisher: pubsub, Topic: "orders.poison"})
	if err != nil {
		panic(err)
	}
	handle := mw(func(msg *message.Message) ([]*message.Message, error) {
		var order struct{ ID int }
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return nil, poison.Decode("order", err)
		}
		if order.ID <= 0 {
			return nil, poison.Permanent(errors.New("order id must be positive"))
		}
		return nil, nil
	})

	_, err = handle(message.NewMessage("m-1", []byte(`{"ID": -4}`)))
	fmt.Println("error returned to the router:", err)

	parked, _ := pubsub.Subscribe(context.Background(), "orders.poison")
	parkedCopy := <-parked
	fmt.Println(parkedCopy.UUID, parkedCopy.Metadata.Get(settle.MetaOutcome), parkedCopy.Metadata.Get(settle.MetaReason))
	parkedCopy.Ack()
	// Output:
	// error returned to the router: <nil>
	// m-1 poisoned permanent: order id must be positive
}
