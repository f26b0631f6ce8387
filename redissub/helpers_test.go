package redissub_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/internal/testenv"
)

const redisURLEnv = "SETTLE_REDIS_URL"

func TestMain(m *testing.M) { testenv.Main(m) }

// newClient opens a client on SETTLE_REDIS_URL, closed at the test's end.
func newClient(t testing.TB) *redis.Client {
	t.Helper()
	opts, err := redis.ParseURL(testenv.Require(t, redisURLEnv))
	if err != nil {
		t.Fatalf("parse %s: %v", redisURLEnv, err)
	}
	c := redis.NewClient(opts)
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("redis ping: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// names returns a stream and a group name of the test's own, the stream
// deleted at the test's end.
func names(t testing.TB, c *redis.Client) (stream, group string) {
	t.Helper()
	id := watermill.NewShortUUID()
	stream, group = "settle-test-"+id, "g-"+id
	t.Cleanup(func() { _ = c.Del(context.Background(), stream).Err() })
	return stream, group
}

// publish publishes msgs to stream with watermill-redisstream's publisher.
func publish(t testing.TB, c redis.UniversalClient, stream string, msgs ...*message.Message) {
	t.Helper()
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: c}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(stream, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

// pendingOf returns the pending entries of group on stream.
func pendingOf(t testing.TB, c redis.UniversalClient, stream, group string) []redis.XPendingExt {
	t.Helper()
	p, err := c.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: stream, Group: group, Start: "-", End: "+", Count: 1000}).Result()
	if err != nil {
		t.Fatalf("xpending: %v", err)
	}
	return p
}

// receive waits for the next message on ch.
func receive(t testing.TB, ch <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		if !ok {
			t.Fatal("subscription closed")
		}
		return m
	case <-time.After(within):
		t.Fatalf("no message within %v", within)
	}
	return nil
}

// none checks that ch yields nothing for d.
func none(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s (metadata %v)", m.UUID, m.Metadata)
		}
	case <-time.After(d):
	}
}
