package poison_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/poison"
)

func TestNewMiddlewareRefusesBadConfig(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	cases := []struct {
		cfg   poison.Config
		field string
	}{
		{poison.Config{Topic: "poison"}, "Config.Publisher"},
		{poison.Config{Publisher: pub}, "Config.Topic"},
		{poison.Config{Publisher: pub, Topic: "poison", NackDelay: -1}, "Config.NackDelay"},
	}
	for _, c := range cases {
		if _, err := poison.NewMiddleware(c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("NewMiddleware(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
}

type failingPublisher struct{}

func (failingPublisher) Publish(string, ...*message.Message) error { return errors.New("no route") }
func (failingPublisher) Close() error                              { return nil }

// A poisoned message whose copy cannot be stored is nacked, never acked.
func TestPublishFailureNacks(t *testing.T) {
	t.Parallel()
	mw, err := poison.NewMiddleware(poison.Config{Publisher: failingPublisher{}, Topic: "poison", NackDelay: 1})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(func(*message.Message) ([]*message.Message, error) {
		return nil, poison.Permanent(errors.New("bad payload"))
	})
	_, err = h(message.NewMessage("m", nil))
	if err == nil || !strings.Contains(err.Error(), "no route") || !poison.IsPermanent(err) {
		t.Fatalf("err = %v; want the publish failure joined with the permanent error", err)
	}
}

func TestTransientErrorsPassThrough(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	mw, err := poison.NewMiddleware(poison.Config{Publisher: pub, Topic: "poison"})
	if err != nil {
		t.Fatal(err)
	}
	transient := errors.New("timeout")
	h := mw(func(*message.Message) ([]*message.Message, error) { return nil, transient })
	if _, err := h(message.NewMessage("m", nil)); !errors.Is(err, transient) {
		t.Fatalf("err = %v; want the transient error unchanged", err)
	}
	msgs, err := pub.Subscribe(t.Context(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		t.Fatalf("a transient failure was parked: %v", m.Metadata.Get(settle.MetaReason))
	default:
	}
}
