package pipeline_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// initializingSub is a GoChannel subscriber that records the topics it is
// asked to declare, and the order of declarations and parked copies.
type initializingSub struct {
	*gochannel.GoChannel
	mu     sync.Mutex
	events []string
	fail   bool
}

func (s *initializingSub) SubscribeInitialize(topic string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events = append(s.events, "declare "+topic)
	if s.fail {
		return errors.New("broker says no")
	}
	return nil
}

func (s *initializingSub) note(e string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events = append(s.events, e)
}

// recordingPub publishes to the GoChannel and notes each publish in the
// subscriber's event log.
type recordingPub struct {
	message.Publisher
	sub *initializingSub
}

func (p recordingPub) Publish(topic string, msgs ...*message.Message) error {
	p.sub.note("publish " + topic)
	return p.Publisher.Publish(topic, msgs...)
}

// The pipeline declares a handler's parking topic through the handler's
// subscriber before each copy, and a failed declaration defers the
// delivery instead of acking it.
func TestPipelineDeclaresParkingTopicsBeforeEachCopy(t *testing.T) {
	t.Parallel()
	for _, fail := range []bool{false, true} {
		t.Run(map[bool]string{false: "declared", true: "declaration fails"}[fail], func(t *testing.T) {
			t.Parallel()
			gc := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
			t.Cleanup(func() { _ = gc.Close() })
			sub := &initializingSub{GoChannel: gc, fail: fail}
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			must(t, err)
			p, err := pipeline.New(router, pipeline.Config{Publisher: recordingPub{gc, sub}, DisableTracing: true, NackDelay: settle.NoDelay})
			must(t, err)
			_, err = p.Handle("h", "orders", sub, func(*message.Message) error {
				return poison.Permanent(errors.New("bad order"))
			})
			must(t, err)
			parked, err := gc.Subscribe(t.Context(), "orders.poison")
			must(t, err)
			go func() { _ = router.Run(context.Background()) }()
			t.Cleanup(func() { _ = router.Close() })
			<-router.Running()
			must(t, gc.Publish("orders", message.NewMessage("m-1", []byte("x"))))
			if fail {
				// Not acked: the delivery comes back, and is declared for
				// again, without a copy.
				deadline := time.Now().Add(10 * time.Second)
				for {
					sub.mu.Lock()
					n := len(sub.events)
					sub.mu.Unlock()
					if n >= 3 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%d declarations within 10s, want the delivery to come back", n)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			sub.mu.Lock()
			events := slices.Clone(sub.events)
			sub.mu.Unlock()
			if fail {
				if slices.ContainsFunc(events, func(e string) bool { return e != "declare orders.poison" }) {
					t.Fatalf("events %v: want declarations and no copy", events)
				}
				return
			}
			select {
			case cp := <-parked:
				cp.Ack()
				if cp.Metadata.Get(settle.MetaOutcome) != string(settle.Poisoned) {
					t.Fatalf("copy %v", cp.Metadata)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("no copy on orders.poison")
			}
			sub.mu.Lock()
			events = slices.Clone(sub.events)
			sub.mu.Unlock()
			if !slices.Equal(events, []string{"declare orders.poison", "publish orders.poison"}) {
				t.Fatalf("events %v: want the declaration before the copy", events)
			}
		})
	}
}
