package dedupe_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
)

type failFirstPublisher struct {
	message.Publisher
	calls atomic.Int64
}

func (p *failFirstPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.calls.Add(1) == 1 {
		return errors.New("broker connection reset")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// A handler's produced messages are published before its key is confirmed:
// when that publish fails, the key is released and the redelivery runs the
// handler again, so the output is not lost (the router would publish it only
// after the confirmation, and its redelivery would be a duplicate).
func TestProducedMessagesArePublishedBeforeConfirm(t *testing.T) {
	t.Parallel()
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8}, watermill.NopLogger{})
	pub := &failFirstPublisher{Publisher: pubsub}
	store := dedupe.NewMemoryStore()
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, Publisher: pub})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	router.AddHandler("ship", "orders", pubsub, "shipments", pubsub, func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return []*message.Message{message.NewMessage("ship-"+msg.UUID, msg.Payload)}, nil
	}).AddMiddleware(dd)

	shipments, err := pubsub.Subscribe(t.Context(), "shipments")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		_ = router.Close()
		<-done
		_ = pubsub.Close()
	})

	// GoChannel's Publish returns once the message was acked.
	if err := pubsub.Publish("orders", message.NewMessage("order-1", []byte("A-17"))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-shipments:
		m.Ack()
		if m.UUID != "ship-order-1" {
			t.Fatalf("shipment %s, want ship-order-1", m.UUID)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the produced message was lost")
	}
	if calls.Load() != 2 || pub.calls.Load() != 2 {
		t.Fatalf("handler calls=%d publishes=%d; want 2 and 2 (failed, then redone)", calls.Load(), pub.calls.Load())
	}
	// The confirmation follows the publish; poll while the claim is held.
	var c dedupe.Claim
	deadline := time.Now().Add(5 * time.Second)
	for c, err = store.Claim(t.Context(), dedupe.ScopedKey("ship", "order-1"), time.Minute); err == nil && c.Result == dedupe.Busy && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
		c, err = store.Claim(t.Context(), dedupe.ScopedKey("ship", "order-1"), time.Minute)
	}
	if err != nil || c.Result != dedupe.Duplicate || c.Attempt != 2 {
		t.Fatalf("claim after = %+v, %v; want Duplicate after 2 attempts", c, err)
	}
}

// A handler that returns messages without Config.Publisher: the delivery
// fails permanently (an *OutputError wrapping ErrOutputWithoutPublisher),
// and its key is confirmed, since the handler's other effects are done: the
// redelivery is a duplicate and does not run the handler again.
func TestProducedMessagesWithoutPublisherFail(t *testing.T) {
	t.Parallel()
	store := dedupe.NewMemoryStore()
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := dd(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		return []*message.Message{message.NewMessage("out", nil)}, nil
	})
	out, err := h(message.NewMessage("in", nil))
	var oe *dedupe.OutputError
	if !errors.Is(err, dedupe.ErrOutputWithoutPublisher) || !errors.As(err, &oe) || oe.Messages != 1 || !settle.IsPermanent(err) || out != nil {
		t.Fatalf("got %v, %v; want a permanent *OutputError for 1 message, wrapping ErrOutputWithoutPublisher, and no messages", out, err)
	}
	c, err := store.Claim(t.Context(), "in", time.Minute)
	if err != nil || c.Result != dedupe.Duplicate {
		t.Fatalf("claim after = %+v, %v; want the key confirmed (Duplicate)", c, err)
	}
	if out, err := h(message.NewMessage("in", nil)); err != nil || out != nil || runs != 1 {
		t.Fatalf("redelivery: %v, %v after %d runs; want a duplicate acked without a second run", out, err, runs)
	}
}
