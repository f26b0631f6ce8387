package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// The crashing relay is this test binary run again with relayCrashEnv=1:
// TestRelayCrashHelperProcess then runs the relay instead of a test. The
// outbox topic travels in relayCrashTopicEnv; the service URLs are inherited.
const (
	relayCrashEnv      = "SETTLE_RELAY_CRASH"
	relayCrashTopicEnv = "SETTLE_RELAY_CRASH_TOPIC"
	// relayCrashExit is the exit code of a relay killed right after the
	// broker confirmed a forwarded message.
	relayCrashExit = 3
	// relayCrashFailExit: the relay could not do its job (setup failed, or
	// it ran out of time).
	relayCrashFailExit = 4
	// relayCrashDeadline bounds the relay process.
	relayCrashDeadline = 20 * time.Second
	// relayCrashPublished prefixes the line on which the relay names the
	// message it published before dying.
	relayCrashPublished = "published "
)

// TestRelayCrashAfterPublishOneEffect proves the outbox's at-least-once edge
// end to end. A relay process publishes the first outbox row to RabbitMQ
// (the broker confirms it) and is killed before it marks the row forwarded.
// A second relay forwards the row again: RabbitMQ really holds two copies of
// that message. A consumer with settle's stack (dedupe on PostgreSQL, then
// the transactional handler) writes exactly one effect per message and acks
// the second copy as a duplicate.
func TestRelayCrashAfterPublishOneEffect(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), obWait)
	defer cancel()
	e := newOBEnv(t, testenv.Postgres(t))
	start := time.Now()
	msgs := obMessages(3, "order")
	if err := e.placeTx(ctx, "order-1", true, msgs); err != nil {
		t.Fatal(err)
	}

	// 1. The relay that dies between publish and marking forwarded.
	code, output := relayCrashRun(t, ctx, append(os.Environ(),
		relayCrashEnv+"=1",
		relayCrashTopicEnv+"="+e.ob.Topic(),
		testenv.PostgresURLEnv+"="+testenv.Require(t, testenv.PostgresURLEnv),
		testenv.AMQPURLEnv+"="+e.url,
	))
	if code != relayCrashExit {
		t.Fatalf("crashing relay exited %d, want %d; output:\n%s", code, relayCrashExit, output)
	}
	var crashed string
	for line := range strings.Lines(output) {
		if id, ok := strings.CutPrefix(strings.TrimSpace(line), relayCrashPublished); ok {
			crashed = id
		}
	}
	if crashed != msgs[0].UUID {
		t.Fatalf("crashing relay published %q, want the first row %s; output:\n%s", crashed, msgs[0].UUID, output)
	}
	e.waitQueue(ctx, 1)
	if p := e.pending(ctx); p != 3 {
		t.Fatalf("%d outbox rows pending after the crash, want 3 (the published row was not marked forwarded)", p)
	}
	crashedAt := time.Since(start)

	// 2. A normal relay forwards every row, the published one again.
	relay := e.startRelay(ctx, e.newPublisher())
	if err := relay.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if err := relay.stop(); err != nil {
		t.Fatal(err)
	}
	if fwd, failed := relay.Counts(); fwd != 3 || failed != 0 {
		t.Fatalf("second relay counts forwarded=%d failed=%d, want 3 and 0", fwd, failed)
	}
	e.waitQueue(ctx, 4) // the duplicate really is on the broker

	// 3. The consumer: one effect per message, the copy acked as a duplicate.
	c := e.startConsumer()
	acked := c.waitAcked(ctx, 4)
	arrivals := map[string]int{}
	var dupUUIDs []string
	for _, d := range acked {
		arrivals[d.uuid]++
		if d.result == dedupe.Duplicate {
			dupUUIDs = append(dupUUIDs, d.uuid)
		}
	}
	for i, m := range msgs {
		want := 1
		if i == 0 {
			want = 2
		}
		if arrivals[m.UUID] != want {
			t.Errorf("message %d (%s) arrived %d times, want %d", i, m.UUID, arrivals[m.UUID], want)
		}
	}
	if len(dupUUIDs) != 1 || dupUUIDs[0] != msgs[0].UUID {
		t.Errorf("deliveries acked as duplicates: %v, want exactly one, of %s", dupUUIDs, msgs[0].UUID)
	}
	rows, distinct := c.effectRows()
	if rows != 3 || distinct != 3 {
		t.Errorf("%d effect rows for %d messages, want 3 for 3", rows, distinct)
	}
	t.Logf("relay crashed after publishing %s in %v; RabbitMQ held 4 copies of 3 messages; %d duplicate acked by dedupe; %d effects; total %v",
		crashed, crashedAt.Round(time.Millisecond), len(dupUUIDs), rows, time.Since(start).Round(time.Millisecond))
}

// relayCrashRun starts the relay process, waits for it to exit and returns
// its exit code and output. A process still running when ctx ends is
// killed.
func relayCrashRun(t *testing.T, ctx context.Context, env []string) (int, string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestRelayCrashHelperProcess$", "-test.count=1")
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String()
	case errors.As(err, &exit) && exit.Exited():
		return exit.ExitCode(), out.String()
	default:
		t.Fatalf("relay process: %v; output:\n%s", err, out.String())
		return -1, ""
	}
}

// TestRelayCrashHelperProcess is not a test: it is the relay process of
// TestRelayCrashAfterPublishOneEffect, run only when that test starts this
// binary with SETTLE_RELAY_CRASH=1.
func TestRelayCrashHelperProcess(t *testing.T) {
	if os.Getenv(relayCrashEnv) != "1" {
		return
	}
	err := relayCrashForward()
	fmt.Fprintln(os.Stderr, "crashing relay: returned without crashing:", err)
	os.Exit(relayCrashFailExit)
}

// relayCrashForward runs a relay whose publisher dies after its first
// successful publish. It returns only if that never happens.
func relayCrashForward() error {
	ctx, cancel := context.WithTimeout(context.Background(), relayCrashDeadline)
	defer cancel()
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	db, dialect, err := sqlurl.Open(os.Getenv(testenv.PostgresURLEnv))
	if err != nil {
		return err
	}
	defer db.Close()
	ob, err := outbox.New(sqldb.Std(db, sqldb.Dialect(dialect)), outbox.Config{Topic: os.Getenv(relayCrashTopicEnv), Logger: logger})
	if err != nil {
		return err
	}
	marshaler, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return err
	}
	cfg := amqp.NewDurableQueueConfig(os.Getenv(testenv.AMQPURLEnv))
	cfg.Marshaler = marshaler
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	relay, err := ob.NewRelay(relayCrashPublisher{pub}, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	defer relay.Close()
	if err := relay.Run(ctx); err != nil {
		return err
	}
	return ctx.Err()
}

// relayCrashPublisher publishes the first message of the relay's batch,
// and once the broker has confirmed it, kills the process before the relay
// can mark the row forwarded: no deferred function runs and the relay's
// transaction is never committed.
type relayCrashPublisher struct{ message.Publisher }

func (p relayCrashPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs[0]); err != nil {
		return err
	}
	fmt.Println(relayCrashPublished + msgs[0].UUID)
	os.Exit(relayCrashExit)
	return nil
}
