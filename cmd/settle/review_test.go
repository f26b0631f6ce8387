package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// review: the -queue name is the operator's input, but it is also a name
// that exists on the broker (anyone who can declare queues chose it): the
// lines that name it (a queue with consumers, a listing cut by -limit, a
// quorum queue read with -force) print it escaped, C1 controls and
// bidirectional overrides included, which the last filter on stdout and
// stderr lets through.
func TestReviewQueueNameIsEscaped(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	declare := func(name string, args amqp091.Table) {
		if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
			t.Fatalf("declare %q: %v", name, err)
		}
		t.Cleanup(func() {
			if ch, err := b.conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(name, false, false, false)
				_ = ch.Close()
			}
		})
		for range 3 {
			if err := ch.Publish("", name, false, false, amqp091.Publishing{Headers: amqp091.Table{"_watermill_message_uuid": testenv.Name(t, "m")}, Body: []byte("x")}); err != nil {
				t.Fatal(err)
			}
		}
	}
	classic := testenv.Name(t, "dlq") + "\u009b2J\u202e"
	declare(classic, nil)
	b.waitDepth(t, classic, 3)
	// A consumer holds one message: the queue has a consumer, 2 ready.
	cch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer cch.Close()
	if err := cch.Qos(1, 0, false); err != nil {
		t.Fatal(err)
	}
	if _, err := cch.Consume(classic, "", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, classic, 2)
	r := mustRun(t, exitOK, "dlq", "list", "-queue", classic, "-limit", "1", "-amqp", b.url)
	if p := unsafeOutput(r.stdout + r.stderr); p != "" {
		t.Errorf("dlq list of a queue with consumers, cut by -limit: %s in\n%v", p, r)
	}
	if !strings.Contains(r.stderr, `\u009b2J`) {
		t.Errorf("the queue's name is not shown escaped:\n%v", r)
	}

	quorum := testenv.Name(t, "qq") + "\u009b2J\u202e"
	declare(quorum, amqp091.Table{"x-queue-type": "quorum"})
	b.waitDepth(t, quorum, 3)
	r = mustRun(t, exitOK, "dlq", "list", "-queue", quorum, "-force", "-amqp", b.url)
	if p := unsafeOutput(r.stdout + r.stderr); p != "" {
		t.Errorf("dlq list -force of a quorum queue: %s in\n%v", p, r)
	}
}

// review: outbox retry's dry run reads at most 10,000 set-aside rows and
// says that many "would be re-queued", but -yes re-queues every set-aside
// row the selection matches: with more rows set aside than that (a
// destination down for a day), the operator approves one number and the
// command acts on another. What -yes does must be what the dry run showed.
func TestReviewOutboxRetryDryRunMatchesYes(t *testing.T) {
	t.Parallel()
	db, u := testenv.Postgres(t), testenv.Require(t, testenv.PostgresURLEnv)
	topic := "cli_rv_" + testenv.Name(t, "r")[len(testenv.Name(t, "r"))-8:]
	ob, err := outbox.New(db.Driver(), outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, tbl := range []string{topic, topic + "_relays"} {
			_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+tbl+`"`)
		}
	})
	const n = 10_005
	if _, err := db.ExecContext(t.Context(), `INSERT INTO "`+topic+`" ("uuid", "topic", "payload", "metadata", "attempts", "last_error", "set_aside_at")
SELECT 'u-' || g, 'refused', '\x7b7d'::bytea, '{}', 5, 'refused', clock_timestamp() FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
	dry := mustRun(t, exitOK, "outbox", "retry", "-db", u, "-topic", topic, "-all", "-json")
	var shown struct {
		Rows []json.RawMessage `json:"rows"`
	}
	if err := json.Unmarshal([]byte(dry.stdout), &shown); err != nil {
		t.Fatal(err)
	}
	yes := mustRun(t, exitOK, "outbox", "retry", "-db", u, "-topic", topic, "-all", "-yes", "-json")
	var did struct {
		Requeued int64 `json:"requeued"`
	}
	if err := json.Unmarshal([]byte(yes.stdout), &did); err != nil {
		t.Fatal(err)
	}
	if int64(len(shown.Rows)) != did.Requeued {
		t.Fatalf("the dry run showed %d rows to re-queue, -yes re-queued %d", len(shown.Rows), did.Requeued)
	}
}

// review: copies whose settle_original_topic is odd (empty, the reserved
// amq. prefix, 300 bytes, control characters, the dead-letter queue itself)
// replayed with -any-destination -yes: no copy leaves the dead-letter
// queue without reaching a queue, nothing loops, and the output is safe.
func TestReviewReplayOddDestinations(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	good := b.queue(t, "orders")
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	dests := []string{"", "amq.rabbitmq.reply-to", "amq.gen-x", strings.Repeat("q", 300), "or\x1bders\u009b\n", dlq, good}
	for i, d := range dests {
		if err := ch.Publish("", dlq, false, false, amqp091.Publishing{
			Headers: amqp091.Table{
				"_watermill_message_uuid": testenv.Name(t, "m") + string(rune('a'+i)),
				"settle_outcome":          "dead_lettered",
				"settle_original_topic":   d,
			},
			DeliveryMode: amqp091.Persistent,
			Body:         []byte("x"),
		}); err != nil {
			t.Fatal(err)
		}
	}
	b.waitDepth(t, dlq, len(dests))
	r := runCmd(t.Context(), nil, "dlq", "replay", "-queue", dlq, "-all", "-any-destination", "-yes", "-amqp", b.url)
	if p := unsafeOutput(r.stdout + r.stderr); p != "" {
		t.Errorf("%s in\n%v", p, r)
	}
	t.Logf("%v", r)
	left, onGood := b.depth(t, dlq), b.depth(t, good)
	if left+onGood != len(dests) {
		t.Errorf("%d copies on the dead-letter queue and %d on %s, want %d in all (a copy went nowhere)\n%v", left, onGood, good, len(dests), r)
	}
}
