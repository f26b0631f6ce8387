package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
)

// broker is a RabbitMQ connection of a test with its own queues.
type broker struct {
	url  string
	conn *amqp091.Connection
}

func setupBroker(t *testing.T) broker {
	t.Helper()
	url := testenv.AMQPURL(t)
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatalf("dial %s: %v", redact(url), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return broker{url: url, conn: conn}
}

// queue declares a durable queue with a unique name, deleted when the test
// ends.
func (b broker) queue(t *testing.T, prefix string) string {
	t.Helper()
	name := testenv.Name(t, prefix)
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatalf("declare %s: %v", name, err)
	}
	t.Cleanup(func() {
		if ch, err := b.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
			_ = ch.Close()
		}
	})
	return name
}

// depth returns the number of ready messages on queue.
func (b broker) depth(t *testing.T, queue string) int {
	t.Helper()
	n, err := queueDepth(b.conn, queue)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitDepth polls until queue holds want ready messages. Messages a command
// handed back are requeued by the broker as their channel closes.
func (b broker) waitDepth(t *testing.T, queue string, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := b.depth(t, queue)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s holds %d messages, want %d", queue, n, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// drain removes and returns every message on queue.
func (b broker) drain(t *testing.T, queue string) []amqp091.Delivery {
	t.Helper()
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	var out []amqp091.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// failure is a message that a handler fails on.
type failure struct {
	uuid, topic, handler, reason string
}

// deadLetter runs a router with settle's retry (one attempt) and dead-letter
// middleware, publishing copies to dlq through watermill-amqp with settle's
// marshaler, and feeds it the failures; it returns when dlq holds all the
// copies. The handlers consume from GoChannel topics named like the RabbitMQ
// queues the copies say they came from.
func deadLetter(t *testing.T, b broker, dlq string, failures []failure) {
	t.Helper()
	logger := watermill.NopLogger{}
	marshaler, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := amqp.NewDurableQueueConfig(b.url)
	cfg.Marshaler = marshaler
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, logger))
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	in := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer in.Close()

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: dlq, Initializer: declaredByTest{}})
	if err != nil {
		t.Fatal(err)
	}
	retry, err := middleware.NewRetry(middleware.RetryConfig{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(dl, retry)
	handlers := map[string]bool{}
	for _, f := range failures {
		key := f.handler + "\x00" + f.topic
		if handlers[key] {
			continue
		}
		handlers[key] = true
		router.AddConsumerHandler(f.handler, f.topic, in, func(msg *message.Message) error {
			return errors.New(msg.Metadata.Get("fail_with"))
		})
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(t.Context()) }()
	defer func() {
		if err := router.Close(); err != nil {
			t.Error(err)
		}
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-router.Running()
	for _, f := range failures {
		msg := message.NewMessage(f.uuid, []byte(`{"id":"`+f.uuid+`"}`))
		msg.Metadata.Set("fail_with", f.reason)
		if err := in.Publish(f.topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	b.waitDepth(t, dlq, len(failures))
}

func TestDLQEndToEnd(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	orders := b.queue(t, "orders")
	emails := b.queue(t, "emails")
	failures := []failure{
		{watermill.NewUUID(), orders, "charge", "card declined"},
		{watermill.NewUUID(), emails, "email", "smtp: 421 try again later"},
		{watermill.NewUUID(), orders, "charge", "card declined"},
	}
	deadLetter(t, b, dlq, failures)
	amqpURL := b.url
	byUUID := map[string]failure{}
	for _, f := range failures {
		byUUID[f.uuid] = f
	}

	t.Run("list", func(t *testing.T) {
		r := mustRun(t, exitOK, "dlq", "list", "-amqp", amqpURL, "-queue", dlq)
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 4 || !strings.HasPrefix(lines[0], "UUID ") {
			t.Fatalf("want a header and 3 rows:\n%v", r)
		}
		var order []string // the queue's order, which a second listing must show again
		for _, row := range lines[1:] {
			order = append(order, strings.Fields(row)[0])
		}
		for _, f := range failures {
			i := slices.Index(order, f.uuid)
			if i < 0 {
				t.Fatalf("%s not listed:\n%s", f.uuid, r.stdout)
			}
			row := lines[i+1]
			for _, want := range []string{"dead_lettered", f.topic, f.handler, f.reason} {
				if !strings.Contains(row, want) {
					t.Errorf("row of %s lacks %q: %s", f.uuid, want, row)
				}
			}
		}
		b.waitDepth(t, dlq, 3) // listing removed nothing

		r = mustRun(t, exitOK, "dlq", "list", "-amqp", amqpURL, "-queue", dlq, "-json")
		var got []entry
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatalf("list -json: %v\n%s", err, r.stdout)
		}
		if len(got) != 3 {
			t.Fatalf("list -json: %d entries, want 3", len(got))
		}
		for i, e := range got {
			if e.UUID != order[i] {
				t.Errorf("second listing: entry %d is %s, the first listing had %s", i, e.UUID, order[i])
			}
			f := byUUID[e.UUID]
			if e.UUID != f.uuid || e.OriginalUUID != f.uuid || e.Outcome != string(settle.DeadLettered) || e.Reason != f.reason ||
				e.OriginalTopic != f.topic || e.Handler != f.handler || e.Attempts != 1 {
				t.Errorf("entry %d = %+v, want %+v", i, e, f)
			}
			first, err1 := time.Parse(time.RFC3339Nano, e.FirstFailure)
			last, err2 := time.Parse(time.RFC3339Nano, e.LastFailure)
			if err1 != nil || err2 != nil || last.Before(first) {
				t.Errorf("entry %d failure times %q, %q", i, e.FirstFailure, e.LastFailure)
			}
		}
		b.waitDepth(t, dlq, 3)

		r = mustRun(t, exitOK, "dlq", "list", "-amqp", amqpURL, "-queue", dlq, "-limit", "2")
		if n := strings.Count(strings.TrimSpace(r.stdout), "\n"); n != 2 || !strings.Contains(r.stderr, "showing the first 2 of 3") {
			t.Errorf("list -limit 2:\n%v", r)
		}
		b.waitDepth(t, dlq, 3)
	})

	t.Run("show", func(t *testing.T) {
		f := failures[1]
		r := mustRun(t, exitOK, "dlq", "show", f.uuid, "-amqp", amqpURL, "-queue", dlq)
		for _, want := range []string{"uuid:", f.uuid, "reason:", f.reason, "handler:", "email", "original topic:", f.topic,
			"payload (", `{"id":"` + f.uuid + `"}`, "fail_with: " + f.reason} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("show lacks %q:\n%s", want, r.stdout)
			}
		}
		if strings.Contains(r.stdout, failures[0].uuid) {
			t.Errorf("show printed another message:\n%s", r.stdout)
		}
		r = mustRun(t, exitFail, "dlq", "show", "-amqp", amqpURL, "-queue", dlq, "no-such-id")
		if !strings.Contains(r.stderr, `no message "no-such-id" on queue `+dlq+" (3 examined)") {
			t.Errorf("show of an unknown id:\n%v", r)
		}
		b.waitDepth(t, dlq, 3)
	})

	t.Run("replay dry run", func(t *testing.T) {
		r := mustRun(t, exitOK, "dlq", "replay", "-amqp", amqpURL, "-queue", dlq, "-handler", "charge")
		if n := strings.Count(r.stdout, "would replay "); n != 2 || !strings.Contains(r.stdout, "nothing changed") {
			t.Errorf("dry run:\n%v", r)
		}
		for _, f := range []failure{failures[0], failures[2]} {
			if !strings.Contains(r.stdout, "would replay "+f.uuid+" (dead_lettered, handler charge) to "+orders+" as "+replayUUID(f.uuid, "charge", 1)) {
				t.Errorf("dry run does not describe %s:\n%s", f.uuid, r.stdout)
			}
		}
		b.waitDepth(t, dlq, 3)
		if n := b.depth(t, orders); n != 0 {
			t.Errorf("dry run published %d messages to %s", n, orders)
		}
	})

	t.Run("replay", func(t *testing.T) {
		r := mustRun(t, exitOK, "dlq", "replay", "-amqp", amqpURL, "-queue", dlq, "-handler", "charge", "-yes", "-progress", "1ns")
		if n := len(regexp.MustCompile(`(?m)^replayed \S+ to \S+ as \S+$`).FindAllString(r.stdout, -1)); n != 2 {
			t.Errorf("want 2 replayed lines:\n%v", r)
		}
		if !strings.Contains(r.stdout, "replayed 2 of 3 examined messages (2 selected, 0 skipped)") {
			t.Errorf("summary:\n%v", r)
		}
		if !strings.Contains(r.stderr, "examined 3 of 3 messages, 2 selected, 2 replayed") {
			t.Errorf("no progress lines:\n%v", r)
		}

		b.waitDepth(t, dlq, 1)
		left := b.drain(t, dlq)
		if len(left) != 1 || left[0].Headers[amqp.DefaultMessageUUIDHeaderKey] != failures[1].uuid {
			t.Fatalf("left on the dead-letter queue: %d messages, want only %s", len(left), failures[1].uuid)
		}

		got := b.drain(t, orders)
		if len(got) != 2 {
			t.Fatalf("%s holds %d messages, want 2", orders, len(got))
		}
		seen := map[string]bool{}
		for i, d := range got {
			old := byUUID[fmt.Sprint(d.Headers[settle.MetaReplayOf])]
			if old.handler != "charge" || seen[old.uuid] {
				t.Fatalf("replayed copy %d is of %v (replay_of %v)", i, old, d.Headers[settle.MetaReplayOf])
			}
			seen[old.uuid] = true
			id, _ := d.Headers[amqp.DefaultMessageUUIDHeaderKey].(string)
			if id == old.uuid || id != replayUUID(old.uuid, "charge", 1) || d.MessageId != id {
				t.Errorf("replayed copy %d: uuid %q, message id %q; want the new uuid %s", i, id, d.MessageId, replayUUID(old.uuid, "charge", 1))
			}
			h := d.Headers
			if h[settle.MetaReplayOf] != old.uuid || h[settle.MetaReplayCount] != "1" || h[settle.MetaReplayReason] != old.reason ||
				h[settle.MetaReplayOutcome] != string(settle.DeadLettered) || h["fail_with"] != old.reason {
				t.Errorf("replayed copy %d headers: %v", i, h)
			}
			if at, err := time.Parse(time.RFC3339Nano, h[settle.MetaReplayedAt].(string)); err != nil || time.Since(at) > time.Minute {
				t.Errorf("replayed copy %d: %s = %v", i, settle.MetaReplayedAt, h[settle.MetaReplayedAt])
			}
			for _, k := range []string{settle.MetaOutcome, settle.MetaReason, settle.MetaAttempt, settle.MetaFirstFailure, settle.MetaLastFailure} {
				if _, ok := h[k]; ok {
					t.Errorf("replayed copy %d keeps %s", i, k)
				}
			}
			if string(d.Body) != `{"id":"`+old.uuid+`"}` {
				t.Errorf("replayed copy %d body %q", i, d.Body)
			}
		}
		if n := b.depth(t, emails); n != 0 {
			t.Errorf("%s got %d messages", emails, n)
		}
	})
}

func TestDLQQueueErrors(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	empty := b.queue(t, "empty")
	missing := testenv.Name(t, "missing")

	r := mustRun(t, exitOK, "dlq", "list", "-amqp", b.url, "-queue", empty)
	if r.stdout != "" || !strings.Contains(r.stderr, `queue "`+empty+`" is empty`) {
		t.Errorf("list of an empty queue:\n%v", r)
	}
	r = mustRun(t, exitOK, "dlq", "list", "-amqp", b.url, "-queue", empty, "-json")
	if strings.TrimSpace(r.stdout) != "[]" {
		t.Errorf("list -json of an empty queue:\n%v", r)
	}
	r = mustRun(t, exitFail, "dlq", "show", "-amqp", b.url, "-queue", empty, "x")
	if !strings.Contains(r.stderr, `settle: queue "`+empty+`" is empty`) {
		t.Errorf("show on an empty queue:\n%v", r)
	}
	r = mustRun(t, exitOK, "dlq", "replay", "-amqp", b.url, "-queue", empty, "-all", "-yes")
	if !strings.Contains(r.stdout, "nothing to replay") {
		t.Errorf("replay of an empty queue:\n%v", r)
	}
	for _, cmd := range [][]string{{"dlq", "list"}, {"dlq", "show", "x"}, {"dlq", "replay", "-all"}} {
		r = mustRun(t, exitFail, append(cmd, "-amqp", b.url, "-queue", missing)...)
		if !strings.Contains(r.stderr, `settle: no queue named "`+missing+`"`) {
			t.Errorf("%v on a missing queue:\n%v", cmd, r)
		}
	}
}

// A replay whose original queue does not exist stops before publishing
// anything and leaves the dead-letter queue as it was; messages without an
// original topic are skipped.
func TestDLQReplayMissingDestination(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	gone := testenv.Name(t, "gone") // never declared
	failures := []failure{{watermill.NewUUID(), gone, "charge", "boom"}}
	deadLetter(t, b, dlq, failures)

	r := mustRun(t, exitOK, "dlq", "replay", "-amqp", b.url, "-queue", dlq, "-all")
	if !strings.Contains(r.stdout, "skip "+failures[0].uuid+`: no queue named "`+gone+`"`) {
		t.Errorf("dry run does not warn about the missing queue:\n%v", r)
	}
	r = mustRun(t, exitFail, "dlq", "replay", "-amqp", b.url, "-queue", dlq, "-all", "-yes")
	if !strings.Contains(r.stderr, `no queue named "`+gone+`"`) || !strings.Contains(r.stdout, "replayed 0 of 1") {
		t.Errorf("replay to a missing queue:\n%v", r)
	}
	b.waitDepth(t, dlq, 1)

	// -to sends it somewhere that exists.
	target := b.queue(t, "target")
	mustRun(t, exitOK, "dlq", "replay", "-amqp", b.url, "-queue", dlq, "-id", failures[0].uuid, "-to", target, "-yes")
	b.waitDepth(t, dlq, 0)
	got := b.drain(t, target)
	if len(got) != 1 || got[0].Headers[settle.MetaReplayOf] != failures[0].uuid {
		t.Errorf("-to: %d messages on %s", len(got), target)
	}
}

// A -handler that no message has selects nothing, and says which handlers
// the queue does have.
func TestDLQReplayUnknownHandler(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	orders, emails := b.queue(t, "orders"), b.queue(t, "emails")
	deadLetter(t, b, dlq, []failure{
		{watermill.NewUUID(), emails, "email", "smtp"},
		{watermill.NewUUID(), orders, "charge", "declined"},
		{watermill.NewUUID(), emails, "email", "smtp"},
	})
	r := mustRun(t, exitOK, "dlq", "replay", "-amqp", b.url, "-queue", dlq, "-handler", "emial")
	if !strings.Contains(r.stdout, "0 of 3 examined messages selected") ||
		!strings.Contains(r.stdout, `no examined message has handler "emial"; the handlers on `+dlq+": email (2), charge (1)") {
		t.Errorf("replay -handler emial:\n%v", r)
	}
	r = mustRun(t, exitOK, "dlq", "replay", "-amqp", b.url, "-queue", dlq, "-handler", "email")
	if strings.Contains(r.stdout, "no examined message has handler") || !strings.Contains(r.stdout, "2 of 3 examined messages selected") {
		t.Errorf("replay -handler email:\n%v", r)
	}
	b.waitDepth(t, dlq, 3)
}

// declaredByTest is the parking Initializer of a test that declared the
// parking queue itself.
type declaredByTest struct{}

func (declaredByTest) SubscribeInitialize(string) error { return nil }
