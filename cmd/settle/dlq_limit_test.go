package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
)

// quorumQueue declares a quorum queue with x-delivery-limit 3, deleted when
// the test ends, holding one dead-letter copy.
func (b broker) quorumQueue(t *testing.T, prefix string) (queue, uuid string) {
	t.Helper()
	queue = testenv.Name(t, prefix)
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(3)}); err != nil {
		t.Fatalf("declare %s: %v", queue, err)
	}
	t.Cleanup(func() {
		if ch, err := b.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(queue, false, false, false)
			_ = ch.Close()
		}
	})
	uuid = testenv.Name(t, "m")
	if err := ch.Publish("", queue, false, false, amqp091.Publishing{
		Headers: amqp091.Table{
			amqp.DefaultMessageUUIDHeaderKey: uuid,
			settle.MetaOutcome:               string(settle.DeadLettered),
			settle.MetaReason:                "card declined",
			settle.MetaOriginalTopic:         "orders",
			settle.MetaHandler:               "charge",
		},
		DeliveryMode: amqp091.Persistent,
		Body:         []byte(`{"order":42}`),
	}); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, queue, 1)
	return queue, uuid
}

// deliveries takes the one message of queue off it and returns its
// x-delivery-count: how many times it was handed back before.
func (b broker) deliveries(t *testing.T, queue string) int64 {
	t.Helper()
	got := b.drain(t, queue)
	if len(got) != 1 {
		t.Fatalf("%s holds %d messages, want 1", queue, len(got))
	}
	n, ok := deliveryCount(got[0])
	if !ok {
		t.Fatalf("no x-delivery-count on a message of quorum queue %s: %v", queue, got[0].Headers)
	}
	return n
}

// On a quorum queue with a delivery limit of 3, every dlq command refuses to
// read without -force, however often it is run, and the message stays with
// its delivery count untouched; with -force it reads, saying what it costs.
func TestDLQRefusesADeliveryLimitedQueue(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq, uuid := b.quorumQueue(t, "qdlq")
	for i := range 6 {
		for _, args := range [][]string{
			{"dlq", "list", "-queue", dlq},
			{"dlq", "show", "-queue", dlq, uuid},
			{"dlq", "replay", "-queue", dlq, "-all"},
		} {
			r := mustRun(t, exitFail, append(args, "-amqp", b.url)...)
			if !strings.Contains(r.stderr, "is a quorum queue") || !strings.Contains(r.stderr, "-force") || r.stdout != "" {
				t.Errorf("run %d of %v:\n%v", i+1, args[:2], r)
			}
		}
		b.waitDepth(t, dlq, 1)
	}

	r := mustRun(t, exitOK, "dlq", "list", "-queue", dlq, "-force", "-amqp", b.url)
	if !strings.Contains(r.stdout, uuid) || !strings.Contains(r.stderr, "warning: queue "+dlq+" is a quorum queue") ||
		!strings.Contains(r.stderr, "delivered up to 0 times before") {
		t.Errorf("list -force:\n%v", r)
	}
	b.waitDepth(t, dlq, 1)
	// 18 refused commands spent nothing; the one forced listing, one
	// delivery.
	if n := b.deliveries(t, dlq); n != 1 {
		t.Errorf("x-delivery-count = %d after 18 refused commands and one forced listing, want 1", n)
	}
}

// A classic queue is read as before, and the probe that tells it from a
// quorum queue moves none of its messages (none is marked redelivered). A
// queue with consumers is read with a warning.
func TestDLQClassicQueueAndConsumers(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", dlq, false, false, amqp091.Publishing{Headers: amqp091.Table{amqp.DefaultMessageUUIDHeaderKey: "u-1"}, Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, dlq, 1)
	ok, err := probeQueueKind(t.Context(), b.url, dlq)
	if err != nil || ok != queueClassic {
		t.Fatalf("probe of a classic queue = %v, %v", ok, err)
	}
	d, got, err := ch.Get(dlq, false)
	if err != nil || !got || d.Redelivered {
		t.Fatalf("after the probe: get = %v, %v, redelivered %v; want the message, never delivered", got, err, d.Redelivered)
	}
	if err := d.Nack(false, true); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, dlq, 1)
	r := mustRun(t, exitOK, "dlq", "list", "-queue", dlq, "-amqp", b.url)
	if !strings.Contains(r.stdout, "u-1") || strings.Contains(r.stderr, "warning") {
		t.Errorf("list of a classic queue:\n%v", r)
	}

	// A consumer on its own connection, holding nothing.
	work := b.queue(t, "work")
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cch.Consume(work, "", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		r = mustRun(t, exitOK, "dlq", "list", "-queue", work, "-amqp", b.url)
		if strings.Contains(r.stderr, "warning: queue "+work+" has 1 consumer(s)") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no warning about the consumer:\n%v", r)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// When the probe cannot tell, the session stops at the first message that
// carries a delivery count.
func TestDLQStopsAtTheFirstCountedDelivery(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq, _ := b.quorumQueue(t, "qdlq")
	var out strings.Builder
	e := &env{ctx: t.Context(), stdout: &out, stderr: &out, getenv: func(string) string { return "" }}
	s, err := openDLQ(e, amqpFlags{url: b.url, queue: dlq, uuidHeader: amqp.DefaultMessageUUIDHeaderKey, force: true})
	if err != nil {
		t.Fatal(err)
	}
	s.counting, s.force = queueMayCount, false
	_, _, ok, err := s.next()
	if ok || !errors.Is(err, errCountsDeliveries) {
		t.Errorf("next = %v, %v; want errCountsDeliveries", ok, err)
	}
	if err := s.close(); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, dlq, 1)
	if n := b.deliveries(t, dlq); n != 1 {
		t.Errorf("x-delivery-count = %d, want 1", n)
	}
}

// A message that carries an integer x-delivery-count stops the reading
// without -force even where the probe found a classic queue: the probe may
// be wrong about a broker it does not know, and the header is what quorum
// queues set.
func TestDLQStopsAtADeliveryCountHeader(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", dlq, false, false, amqp091.Publishing{
		Headers: amqp091.Table{amqp.DefaultMessageUUIDHeaderKey: "u-1", "x-delivery-count": int32(2)}, Body: []byte("x"),
	}); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, dlq, 1)
	r := mustRun(t, exitFail, "dlq", "list", "-queue", dlq, "-amqp", b.url)
	if !strings.Contains(r.stderr, "carries x-delivery-count 2") || !strings.Contains(r.stderr, "-force") {
		t.Errorf("list:\n%v", r)
	}
	b.waitDepth(t, dlq, 1)
	r = mustRun(t, exitOK, "dlq", "list", "-queue", dlq, "-force", "-amqp", b.url)
	if !strings.Contains(r.stdout, "u-1") {
		t.Errorf("list -force:\n%v", r)
	}
	b.waitDepth(t, dlq, 1)
}
