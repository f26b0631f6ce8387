package natsjs_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// A handler that outlasts AckWait: JetStream delivers its message again, to
// the other consumer, while it runs. The dedupe store's claim (renewed while
// the handler runs) defers that delivery, and once the first run confirms,
// the next one is acked as a duplicate: one run, nothing left unacked.
func TestHandlerOutlastsAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.publish(t, message.NewMessage("slow-1", []byte("{}")))
	store := dedupe.NewMemoryStore() // one store for both consumers, as a database would be

	var runs atomic.Int32
	for range 2 {
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
		if err != nil {
			t.Fatal(err)
		}
		p, err := pipeline.New(r, pipeline.Config{Publisher: e.publisher(t), Store: store, DisableTracing: true,
			ClaimTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		sub := e.subscriber(t, natsjs.Config{Durable: "slow", AckWait: time.Second, MaxAckPending: 2})
		if _, err := p.Handle("slow", e.topic, sub, func(*message.Message) error {
			runs.Add(1)
			time.Sleep(2500 * time.Millisecond)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		runRouterOnly(t, r)
	}
	time.Sleep(500 * time.Millisecond)
	e.waitSettled(t, "slow", 15*time.Second)
	if got := runs.Load(); got != 1 {
		t.Errorf("handler ran %d times, want 1", got)
	}
	if got := e.consumerInfo(t, "slow").Delivered.Consumer; got < 2 {
		t.Errorf("%d deliveries: want the message delivered again while its handler ran", got)
	}
}
