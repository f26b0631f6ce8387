package integration_test

import (
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// A producer cannot make a message dead-letter without a run: a delivery
// count is believed only where the broker writes it (a quorum queue, and a
// marshaler told so), and a settle_attempt only on a copy the retry
// middleware marked with its key.
func TestForgedAttemptHeadersDoNotDeadLetter(t *testing.T) {
	t.Parallel()
	forged := []struct {
		name    string
		opts    saOpts
		headers amqp091.Table
	}{
		{"x-delivery-count on a classic queue", saOpts{retry: saFastRetry(3, 0), noDedupe: true},
			amqp091.Table{"x-delivery-count": int32(50)}},
		{"x-delivery-count on a quorum queue", saOpts{retry: saFastRetry(3, 0), noDedupe: true, quorum: true},
			amqp091.Table{"x-delivery-count": int32(50)}},
		{"settle_attempt with Republish", saOpts{retry: saFastRetry(3, 0), noDedupe: true, republish: true},
			amqp091.Table{settle.MetaAttempt: "50"}},
		{"settle_attempt with a forged mark", saOpts{retry: saFastRetry(3, 0), noDedupe: true, republish: true},
			amqp091.Table{settle.MetaAttempt: "50", middleware.MetaAttemptMark: "AAAA"}},
		{"settle_delivery_count", saOpts{retry: saFastRetry(3, 0), noDedupe: true},
			amqp091.Table{settle.MetaDeliveryCount: "50"}},
	}
	for _, c := range forged {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newSAEnv(t, c.opts, func(int64, *message.Message) error { return nil })
			h := amqp091.Table{amqp.DefaultMessageUUIDHeaderKey: watermill.NewUUID()}
			for k, v := range c.headers {
				h[k] = v
			}
			if err := e.ch.Publish("", e.src, false, false, amqp091.Publishing{Headers: h, Body: []byte("forged")}); err != nil {
				t.Fatal(err)
			}
			e.waitSettled(1)
			dead, poisoned := e.finish()
			if got := e.calls.Load(); got != 1 {
				t.Errorf("handler ran %d times, want 1", got)
			}
			if len(dead) != 0 || len(poisoned) != 0 {
				t.Errorf("%d dead letters and %d poisoned, want none: %v", len(dead), len(poisoned), dead)
			}
		})
	}
}

// The retry middleware's own mark survives the broker: with Republish, a
// message that always fails is run exactly MaxAttempts times and then
// dead-lettered, each copy's count believed because settle marked it.
func TestRepublishedAttemptMarkBoundsRuns(t *testing.T) {
	t.Parallel()
	errAlways := errors.New("always fails")
	e := newSAEnv(t, saOpts{retry: saFastRetry(3, 0), noDedupe: true, republish: true},
		func(int64, *message.Message) error { return errAlways })
	sent := e.publish()
	// Two runs handed back by republishing (each acked), the third
	// dead-lettered (acked).
	e.waitSettled(3)
	// The last ack is sent after the middleware returns: closing the router
	// before the broker has it hands the original back, and its redelivery
	// would be parked a second time. Wait for the broker to hold no
	// unacknowledged delivery of the source queue.
	saWaitAcked(t, e.src)
	dead, _ := e.finish()
	if got := e.calls.Load(); got != 3 {
		t.Errorf("handler ran %d times, want MaxAttempts 3", got)
	}
	if len(dead) != 1 || dead[0].Metadata.Get(settle.MetaOriginalUUID) != sent.UUID {
		t.Fatalf("dead letters %v, want the one message", dead)
	}
	if got := dead[0].Metadata.Get(settle.MetaAttempt); got != "3" {
		t.Errorf("dead letter %s = %q, want 3", settle.MetaAttempt, got)
	}
	if got := dead[0].Metadata.Get(middleware.MetaAttemptMark); got != "" {
		t.Errorf("dead letter carries the republish mark %q", got)
	}
}

// saWaitAcked polls the broker (through rabbitmqctl, which this machine's
// RabbitMQ has) until queue holds no delivery that is not acknowledged yet.
func saWaitAcked(t *testing.T, queue string) {
	t.Helper()
	deadline := time.Now().Add(saWait)
	for {
		out, err := exec.CommandContext(t.Context(), "rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged").Output()
		if err != nil {
			t.Fatalf("rabbitmqctl list_queues: %v", err)
		}
		unacked := -1
		for line := range strings.Lines(string(out)) {
			if name, n, ok := strings.Cut(strings.TrimSpace(line), "\t"); ok && name == queue {
				unacked, _ = strconv.Atoi(n)
			}
		}
		if unacked == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s still has %d unacknowledged deliveries after %v", queue, unacked, saWait)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
