package redissub_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
	"github.com/settle-go/settle/redissub"
)

// The edges that made NATS copies unpublishable, on Redis Streams: a
// payload of 8 MiB (eight times NATS's max_payload) and headers just under
// 64 KiB. Redis bounds each field of an entry at 512 MiB (proto-max-bulk-len)
// and keeps payload and metadata in separate fields, so every copy goes the
// first time: the payload whole, a header that fits kept intact, one that
// does not left out and named, and nothing left pending.
func TestCopiesOfLargeMessagesArePublished(t *testing.T) {
	t.Parallel()
	c := newClient(t)
	stream, group := names(t, c)
	parking := stream + ".poison"
	t.Cleanup(func() { _ = c.Del(context.Background(), parking).Err() })
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: c}, nil)
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("x"), 8<<20)
	msgs := map[string]*message.Message{}
	add := func(uuid string, payload []byte, header int) {
		m := message.NewMessage(uuid, payload)
		m.Metadata.Set("x-big", strings.Repeat("a", header))
		m.Metadata.Set("x-small", "s")
		msgs[uuid] = m
		publish(t, c, stream, m)
	}
	add("payload-8mib", big, 10)
	add("header-60k", []byte("p"), 60000)
	add("header-65k", []byte("p"), 65400)

	sub := newSub(t, c, redissub.Config{ConsumerGroup: group})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, PoisonTopic: parking, DisableTracing: true, NackDelay: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Handle("h", stream, sub, func(*message.Message) error {
		return poison.Permanent(errors.New("refused"))
	}); err != nil {
		t.Fatal(err)
	}
	runRouter(t, router, func() bool { return c.XLen(context.Background(), parking).Val() == int64(len(msgs)) })
	waitPending(t, c, stream, group, 0)
	entries, err := c.XRange(context.Background(), parking, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(msgs) {
		t.Fatalf("%d copies; want %d, each published once", len(entries), len(msgs))
	}
	for _, e := range entries {
		cp, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(e.Values)
		if err != nil {
			t.Fatal(err)
		}
		orig := msgs[cp.UUID]
		if orig == nil {
			t.Fatalf("copy of an unknown message %q", cp.UUID)
		}
		if !bytes.Equal(cp.Payload, orig.Payload) || cp.Metadata.Get(middleware.MetaPayloadLeftOut) != "" {
			t.Errorf("%s: the copy's payload is %d bytes (left out: %q); want the original's %d", cp.UUID, len(cp.Payload), cp.Metadata.Get(middleware.MetaPayloadLeftOut), len(orig.Payload))
		}
		if cp.Metadata.Get(settle.MetaOutcome) != string(settle.Poisoned) || cp.Metadata.Get("x-small") != "s" {
			t.Errorf("%s: outcome %q, x-small %q; want poisoned and s", cp.UUID, cp.Metadata.Get(settle.MetaOutcome), cp.Metadata.Get("x-small"))
		}
		dropped := cp.Metadata.Get(middleware.MetaDroppedHeaders)
		switch cp.UUID {
		case "header-65k": // over MaxMetadataBytes (64 KiB) with settle's keys
			if cp.Metadata.Get("x-big") != "" || !strings.Contains(dropped, `"x-big"`) {
				t.Errorf("%s: x-big of %d bytes, dropped %q; want it left out and named", cp.UUID, len(cp.Metadata.Get("x-big")), dropped)
			}
		default:
			if cp.Metadata.Get("x-big") != orig.Metadata.Get("x-big") || dropped != "" {
				t.Errorf("%s: x-big of %d bytes, dropped %q; want it intact", cp.UUID, len(cp.Metadata.Get("x-big")), dropped)
			}
		}
	}
}
