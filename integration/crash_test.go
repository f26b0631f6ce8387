package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/sqldb"
)

// The crash consumer is this test binary run again with crashHelperEnv=1:
// TestCrashConsumerHelperProcess then runs the consumer instead of a test.
// Its configuration travels in the other crash* environment variables; the
// service URLs are inherited.
const (
	crashHelperEnv = "SETTLE_CRASH_CONSUMER"
	crashSrcEnv    = "SETTLE_CRASH_SOURCE_QUEUE"
	crashDeadEnv   = "SETTLE_CRASH_DEAD_QUEUE"
	crashClaimsEnv = "SETTLE_CRASH_DEDUPE_TABLE"
	crashRunsEnv   = "SETTLE_CRASH_RUNS_TABLE"

	crashMaxAttempts = 3
	crashHandler     = "crash_on_charge"
	// crashExit is the exit code of a consumer killed by the message.
	crashExit = 3
	// crashFailExit is the exit code of a consumer that could not do its job
	// (setup failed, or it ran out of time).
	crashFailExit = 4
	// crashDeadline bounds one consumer process.
	crashDeadline = 20 * time.Second
	// crashIdle: a consumer with nothing in flight exits 0 after this long
	// without a delivery, or crashSettleIdle after it dead-lettered.
	crashIdle       = 2 * time.Second
	crashSettleIdle = 200 * time.Millisecond
)

// TestCrashMessageIsDeadLetteredAfterMaxAttempts proves that a message which
// kills its consumer every time still ends on the dead-letter queue, after
// exactly MaxAttempts runs of the handler, in a bounded number of process
// starts. Each consumer process records its entry into the handler in
// PostgreSQL and then exits with code 3, as a segfault or OOM kill would end
// it: nothing in the process gets to count the failure. The count survives
// because the dedupe store increments it with every claim; the claim of the
// dead process lapses after the short ClaimTimeout and the next process takes
// it over. With the attempts used up, the next process does not start the
// handler: it dead-letters the message and acks it.
func TestCrashMessageIsDeadLetteredAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	db := testenv.Postgres(t)
	pgURL := testenv.Require(t, testenv.PostgresURLEnv)
	src, dead := testenv.Name(t, "crash_src"), testenv.Name(t, "crash_dead")
	claims := testenv.DedupeTable(t, db)
	runs := testenv.Name(t, "crash_runs")
	if _, err := db.ExecContext(t.Context(), `CREATE TABLE "`+runs+`" (
		pid int NOT NULL, message_uuid text NOT NULL, claim_attempt int NOT NULL, at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+runs+`"`) })

	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{src, dead} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("delete queue %s: %v", q, err)
			}
		}
	})
	for _, q := range []string{src, dead} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatalf("declare queue %s: %v", q, err)
		}
	}
	marshaler, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatal(err)
	}

	// Publish the message once, with publisher confirms.
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"crash"}`))
	pubCfg := amqp.NewDurableQueueConfig(url)
	pubCfg.Marshaler = marshaler
	pubCfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(pubCfg, testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(pub.Publish(src, msg), pub.Close()); err != nil {
		t.Fatalf("publish: %v", err)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	env := append(os.Environ(),
		crashHelperEnv+"=1",
		crashSrcEnv+"="+src,
		crashDeadEnv+"="+dead,
		crashClaimsEnv+"="+claims,
		crashRunsEnv+"="+runs,
		testenv.PostgresURLEnv+"="+pgURL,
		testenv.AMQPURLEnv+"="+url,
	)
	const maxStarts = crashMaxAttempts + 3
	var codes []int
	start := time.Now()
	for len(codes) < maxStarts {
		code, output := crashRunConsumer(t, ctx, env)
		codes = append(codes, code)
		if code != 0 && code != crashExit {
			t.Fatalf("consumer start %d exited %d, want 0 or %d; output:\n%s", len(codes), code, crashExit, output)
		}
		t.Logf("consumer start %d exited %d", len(codes), code)
		q, err := ch.QueueDeclarePassive(dead, true, false, false, false, nil)
		if err != nil {
			t.Fatalf("inspect queue %s: %v", dead, err)
		}
		if q.Messages > 0 {
			break
		}
	}
	t.Logf("%d consumer starts in %v", len(codes), time.Since(start).Round(time.Millisecond))

	// The handler ran exactly MaxAttempts times, once per process, with the
	// claim's durable attempt count 1, 2, 3.
	rows, err := db.QueryContext(t.Context(), `SELECT pid, message_uuid, claim_attempt FROM "`+runs+`" ORDER BY at`)
	if err != nil {
		t.Fatal(err)
	}
	var attempts []int
	pids := map[int]bool{}
	for rows.Next() {
		var pid, attempt int
		var uuid string
		if err := rows.Scan(&pid, &uuid, &attempt); err != nil {
			t.Fatal(err)
		}
		if uuid != msg.UUID {
			t.Errorf("handler ran for message %q, want %q", uuid, msg.UUID)
		}
		attempts = append(attempts, attempt)
		pids[pid] = true
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(attempts), "[1 2 3]"; got != want {
		t.Errorf("handler runs by claim attempt = %s, want %s (exactly MaxAttempts=%d runs)", got, want, crashMaxAttempts)
	}
	if len(pids) != len(attempts) {
		t.Errorf("%d handler runs in %d processes, want one run per process", len(attempts), len(pids))
	}
	// Every crashing run died with the message; then one start dead-lettered
	// it and exited on its own.
	if got, want := fmt.Sprint(codes), fmt.Sprint([]int{crashExit, crashExit, crashExit, 0}); got != want {
		t.Errorf("consumer exit codes = %s, want %s", got, want)
	}
	if len(codes) > maxStarts {
		t.Errorf("%d consumer starts, want at most %d", len(codes), maxStarts)
	}

	// Exactly one copy on the dead-letter queue, saying why.
	copies := saDrain(t, ch, marshaler, dead)
	if len(copies) != 1 {
		t.Fatalf("dead-letter queue holds %d copies, want 1", len(copies))
	}
	md := copies[0].Metadata
	reason := fmt.Sprintf("%v: %d attempts made, limit is %d", dedupe.ErrAttemptsUsedUp, crashMaxAttempts, crashMaxAttempts)
	for k, v := range map[string]string{
		settle.MetaOutcome:       string(settle.DeadLettered),
		settle.MetaAttempt:       strconv.Itoa(crashMaxAttempts),
		settle.MetaOriginalUUID:  msg.UUID,
		settle.MetaOriginalTopic: src,
		settle.MetaHandler:       crashHandler,
		settle.MetaReason:        reason,
	} {
		if got := md.Get(k); got != v {
			t.Errorf("dead-letter copy: %s = %q, want %q", k, got, v)
		}
	}
	if copies[0].UUID != msg.UUID || string(copies[0].Payload) != string(msg.Payload) {
		t.Errorf("dead-letter copy: UUID %q payload %q, want the original", copies[0].UUID, copies[0].Payload)
	}
	// And nothing is left on the source queue.
	if n := saQueueAfterConsumersLeft(t, ch, src, nil); n != 0 {
		t.Errorf("source queue %s holds %d messages, want 0", src, n)
	}
}

// crashRunConsumer starts one consumer process, waits for it to exit and
// returns its exit code and output. A process still running when ctx ends is
// killed.
func crashRunConsumer(t *testing.T, ctx context.Context, env []string) (int, string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestCrashConsumerHelperProcess$", "-test.count=1")
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("start consumer: %v", err)
	}
	t.Cleanup(func() {
		// Only if the test ended before Wait returned.
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	err := cmd.Wait()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String()
	case errors.As(err, &exit) && exit.Exited():
		return exit.ExitCode(), out.String()
	default:
		t.Fatalf("consumer: %v; output:\n%s", err, out.String())
		return -1, ""
	}
}

// TestCrashConsumerHelperProcess is not a test: it is the consumer process of
// TestCrashMessageIsDeadLetteredAfterMaxAttempts, run only when that test
// starts this binary with SETTLE_CRASH_CONSUMER=1.
func TestCrashConsumerHelperProcess(t *testing.T) {
	if os.Getenv(crashHelperEnv) != "1" {
		return
	}
	if err := crashConsume(); err != nil {
		fmt.Fprintln(os.Stderr, "crash consumer:", err)
		os.Exit(crashFailExit)
	}
	os.Exit(0)
}

// crashConsume consumes the source queue with settle's stack until it
// dead-lettered a message and went quiet, or was idle for crashIdle. Its
// handler records each run and then kills the process.
func crashConsume() error {
	ctx, cancel := context.WithTimeout(context.Background(), crashDeadline)
	defer cancel()
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	src, dead := os.Getenv(crashSrcEnv), os.Getenv(crashDeadEnv)
	runs := os.Getenv(crashRunsEnv)

	db, dialect, err := sqlurl.Open(os.Getenv(testenv.PostgresURLEnv))
	if err != nil {
		return err
	}
	defer db.Close()
	store, err := dedupe.NewSQLStore(sqldb.Std(db, dialect), dedupe.SQLConfig{Table: os.Getenv(crashClaimsEnv)})
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
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()

	w := &crashWatch{last: time.Now()}
	deadPub := &crashDeadPublisher{Publisher: pub, w: w}
	ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: deadPub, Topic: dead, NackDelay: 20 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: deadPub, Topic: dead, NackDelay: 20 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	rt, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts:     crashMaxAttempts,
		InitialInterval: time.Millisecond,
		MaxInterval:     5 * time.Millisecond,
		RedeliveryDelay: 5 * time.Millisecond,
		StoreCounts:     true, // the dedupe middleware inside counts the runs
		Logger:          logger,
	})
	if err != nil {
		return err
	}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: 300 * time.Millisecond, BusyDelay: 20 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler(crashHandler, src, sub, func(msg *message.Message) error {
		claim, _ := dedupe.ClaimFromContext(msg.Context())
		if _, err := db.ExecContext(msg.Context(), `INSERT INTO "`+runs+`" (pid, message_uuid, claim_attempt) VALUES ($1, $2, $3)`,
			os.Getpid(), msg.UUID, claim.Attempt); err != nil {
			return err
		}
		// The message kills the process, as a segfault would: no deferred
		// function runs, nothing is released, nacked or counted.
		os.Exit(crashExit)
		return nil
	}).AddMiddleware(w.observe, ps, dl, rt, dd)

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-runErr:
			if ctx.Err() != nil {
				return fmt.Errorf("gave up after %v: %w", crashDeadline, ctx.Err())
			}
			return err
		case <-tick.C:
		}
		if w.quiet() {
			if err := router.Close(); err != nil {
				return err
			}
			return <-runErr
		}
	}
}

// crashWatch tells when a consumer has nothing left to do.
type crashWatch struct {
	mu           sync.Mutex
	inflight     int
	last         time.Time // the start, or when the last delivery settled
	deadLettered atomic.Bool
}

func (w *crashWatch) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		w.mu.Lock()
		w.inflight++
		w.mu.Unlock()
		defer func() {
			w.mu.Lock()
			w.inflight--
			w.last = time.Now()
			w.mu.Unlock()
		}()
		return h(msg)
	}
}

// quiet reports whether nothing is in flight and nothing was delivered for
// crashSettleIdle after a dead-letter, or for crashIdle otherwise. By then
// the subscriber has long acked the last delivery.
func (w *crashWatch) quiet() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	idle := crashIdle
	if w.deadLettered.Load() {
		idle = crashSettleIdle
	}
	return w.inflight == 0 && time.Since(w.last) > idle
}

// crashDeadPublisher notes that a copy reached the dead-letter queue.
type crashDeadPublisher struct {
	message.Publisher
	w *crashWatch
}

func (p *crashDeadPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.w.deadLettered.Store(true)
	return nil
}
