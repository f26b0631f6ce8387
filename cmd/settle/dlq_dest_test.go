package main

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
)

// A copy forged onto a dead-letter queue, naming another queue as its
// origin, is not replayed there unless the operator says so: a selection
// that spans several destinations is refused without -to, -allow-topics or
// -any-destination, and the dry run shows the destinations.
func TestDLQReplayRefusesSeveralDestinations(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	orders := b.queue(t, "orders")
	payments := b.queue(t, "payments")
	genuine := []failure{
		{watermill.NewUUID(), orders, "charge", "card declined"},
		{watermill.NewUUID(), orders, "charge", "card declined"},
	}
	deadLetter(t, b, dlq, genuine)
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	// copyTo publishes onto the dead-letter queue a copy that names topic
	// as its origin, as anyone who can publish there can.
	copyTo := func(topic string) string {
		t.Helper()
		id := watermill.NewUUID()
		if err := ch.Publish("", dlq, false, false, amqp091.Publishing{
			Headers: amqp091.Table{
				amqp.DefaultMessageUUIDHeaderKey: id,
				settle.MetaOutcome:               string(settle.DeadLettered),
				settle.MetaReason:                "card declined",
				settle.MetaOriginalTopic:         topic,
				settle.MetaHandler:               "charge",
			},
			Body: []byte(`{"refund":"everything"}`),
		}); err != nil {
			t.Fatal(err)
		}
		return id
	}
	forged := copyTo(payments)
	b.waitDepth(t, dlq, 3)

	// The dry run shows both destinations and says -yes would be refused.
	r := mustRun(t, exitOK, "dlq", "replay", "-queue", dlq, "-all", "-amqp", b.url)
	if !strings.Contains(r.stdout, "the 3 selected messages go to 2 destinations: "+orders+" (2), "+payments+" (1)") ||
		!strings.Contains(r.stdout, "with -yes this replay is refused") {
		t.Errorf("dry run:\n%v", r)
	}
	// -yes alone: refused before anything is published.
	for _, args := range [][]string{{"-all"}, {"-handler", "charge"}, {"-reason", "declined"}} {
		r = mustRun(t, exitFail, append([]string{"dlq", "replay", "-queue", dlq, "-yes", "-amqp", b.url}, args...)...)
		if !strings.Contains(r.stderr, "the selected messages go to 2 destinations") || !strings.Contains(r.stderr, "-allow-topics") {
			t.Errorf("replay %v -yes:\n%v", args, r)
		}
		b.waitDepth(t, dlq, 3)
		if n, m := b.depth(t, orders), b.depth(t, payments); n != 0 || m != 0 {
			t.Fatalf("a refused replay published %d to %s and %d to %s", n, orders, m, payments)
		}
	}
	// -allow-topics replays to the named destinations only.
	r = mustRun(t, exitOK, "dlq", "replay", "-queue", dlq, "-all", "-allow-topics", orders, "-yes", "-amqp", b.url)
	if !strings.Contains(r.stdout, "skip "+forged+": destination "+payments+" is not in -allow-topics") ||
		!strings.Contains(r.stdout, "replayed 2 of 3 examined messages") {
		t.Errorf("-allow-topics:\n%v", r)
	}
	b.waitDepth(t, orders, 2)
	b.waitDepth(t, dlq, 1)
	if n := b.depth(t, payments); n != 0 {
		t.Errorf("the forged copy reached %s", payments)
	}
	// An explicit -any-destination sends it where it says.
	copyTo(orders)
	b.waitDepth(t, dlq, 2)
	mustRun(t, exitFail, "dlq", "replay", "-queue", dlq, "-all", "-yes", "-amqp", b.url)
	r = mustRun(t, exitOK, "dlq", "replay", "-queue", dlq, "-all", "-any-destination", "-yes", "-amqp", b.url)
	if !strings.Contains(r.stdout, "replayed "+forged+" to "+payments) {
		t.Errorf("-any-destination:\n%v", r)
	}
	b.waitDepth(t, payments, 1)
	b.waitDepth(t, orders, 3)
	b.waitDepth(t, dlq, 0)
	// -to and the allow flags exclude each other.
	r = mustRun(t, exitUsage, "dlq", "replay", "-queue", dlq, "-all", "-to", orders, "-any-destination")
	if !strings.Contains(r.stderr, "-to cannot be combined") {
		t.Errorf("-to with -any-destination:\n%v", r)
	}
}
