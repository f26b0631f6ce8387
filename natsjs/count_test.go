package natsjs_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/natsjs"
)

// deliver runs h on one message as a router would: ack on success, nack on
// error.
func deliver(msg *message.Message, h message.HandlerFunc) error {
	_, err := h(msg)
	if err != nil {
		msg.Nack()
	} else {
		msg.Ack()
	}
	return err
}

// forged publishes a message whose headers claim, under settle's names, that
// it was delivered 50 times, and that the broker holds its nacks an hour,
// with marks a producer can only make up.
func forged(t *testing.T, e env, uuid string) {
	t.Helper()
	m := nats.NewMsg(e.topic)
	m.Header.Set(wmnats.WatermillUUIDHdr, uuid)
	m.Header.Set(settle.MetaDeliveryCount, "50")
	m.Header.Set("settle_delivery_count_mark", "bm90IGEgbWFyaw")
	m.Header.Set(settle.MetaRedelivered, "true")
	m.Header.Set("settle_nak_delay", "1h")
	m.Header.Set("settle_nak_delay_mark", "bm90IGEgbWFyaw")
	m.Data = []byte("{}")
	if _, err := e.js.PublishMsg(m); err != nil {
		t.Fatal(err)
	}
}

// A producer's settle_delivery_count is not the broker's: the delivery
// carries JetStream's own count, and the handler runs instead of the
// message being dead-lettered as if its attempts were used up.
func TestForgedDeliveryCountIgnored(t *testing.T) {
	t.Parallel()
	e := setup(t)
	forged(t, e, "forged-1")

	retry, err := middleware.NewRetry(middleware.RetryConfig{MaxAttempts: 5})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := retry(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })

	t.Run("natsjs", func(t *testing.T) {
		ch := subscribe(t, e.subscriber(t, natsjs.Config{Durable: "settle"}), e.topic)
		msg := next(t, ch, 5*time.Second)
		if got := msg.Metadata.Get(settle.MetaDeliveryCount); got != "1" {
			t.Errorf("%s = %q, want JetStream's 1", settle.MetaDeliveryCount, got)
		}
		if got := msg.Metadata.Get(settle.MetaRedelivered); got != "false" {
			t.Errorf("%s = %q, want false", settle.MetaRedelivered, got)
		}
		if err := deliver(msg, h); err != nil {
			t.Fatalf("delivery failed: %v", err)
		}
		if runs.Load() != 1 {
			t.Fatalf("handler ran %d times, want 1", runs.Load())
		}
		e.waitSettled(t, "settle", 5*time.Second)
	})

	// watermill-nats' own unmarshaler passes the producer's headers on as
	// they are: the retry middleware must not believe them either.
	t.Run("stock unmarshaler", func(t *testing.T) {
		runs.Store(0)
		cfg := wmnats.SubscriberConfig{
			URL: e.url, QueueGroupPrefix: "stock", AckWaitTimeout: 5 * time.Second,
			JetStream: wmnats.JetStreamConfig{DurablePrefix: "stock", SubscribeOptions: []nats.SubOpt{nats.ManualAck()}},
		}
		sub, err := wmnats.NewSubscriber(cfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Close() })
		msg := next(t, subscribe(t, sub, e.topic), 5*time.Second)
		if got := msg.Metadata.Get(settle.MetaDeliveryCount); got != "50" {
			t.Fatalf("stock unmarshaler: %s = %q, want the producer's 50", settle.MetaDeliveryCount, got)
		}
		if err := deliver(msg, h); err != nil {
			t.Fatalf("delivery failed: %v", err)
		}
		if runs.Load() != 1 {
			t.Fatalf("handler ran %d times, want 1", runs.Load())
		}
	})
}

// Where no dedupe store counts, JetStream's delivery count bounds the runs:
// each delivery is taken by a retry middleware that remembers nothing (a
// restarted consumer), and still the handler runs MaxAttempts times in all,
// then one copy goes to the dead-letter topic and the original is acked.
func TestDeliveryCountBoundsAttempts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.publish(t, message.NewMessage("always-fails", []byte("{}")))
	pub := e.publisher(t)
	dlTopic := e.topic + ".dead_letter"

	const maxAttempts = 3
	ch := subscribe(t, e.subscriber(t, natsjs.Config{Durable: "settle", NakDelay: 20 * time.Millisecond}), e.topic)
	var runs int
	for range 2 * maxAttempts {
		msg := func() *message.Message {
			select {
			case m := <-ch:
				return m
			case <-time.After(2 * time.Second):
				return nil
			}
		}()
		if msg == nil {
			break
		}
		// A fresh stack per delivery: nothing is remembered in process.
		retry, err := middleware.NewRetry(middleware.RetryConfig{MaxAttempts: maxAttempts, NoInProcessRetries: true, RedeliveryDelay: settle.NoDelay})
		if err != nil {
			t.Fatal(err)
		}
		dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: dlTopic})
		if err != nil {
			t.Fatal(err)
		}
		_ = deliver(msg, dl(retry(func(*message.Message) ([]*message.Message, error) {
			runs++
			return nil, errors.New("downstream refuses")
		})))
	}
	if runs != maxAttempts {
		t.Errorf("handler ran %d times, want exactly MaxAttempts %d", runs, maxAttempts)
	}
	if n := e.streamCount(t, dlTopic); n != 1 {
		t.Errorf("%d copies on the dead-letter topic, want 1", n)
	}
	e.waitSettled(t, "settle", 5*time.Second)
}
