package integration_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

func atRetry(maxAttempts, inProcess int) middleware.RetryConfig {
	cfg := middleware.RetryConfig{
		MaxAttempts: maxAttempts, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond,
		RedeliveryDelay: 20 * time.Millisecond,
	}
	if inProcess == 0 {
		cfg.NoInProcessRetries = true
	} else {
		cfg.InProcessRetries = inProcess
	}
	return cfg
}

// Item 1: messages flow at a steady pace through two competing consumers
// while the claims table is renamed away for 5 seconds. No message is
// dead-lettered or run while the store cannot answer; afterwards every
// message is done once; settle logs the outage at a rate a person can read.
func TestAttemptsStoreOutageDefers(t *testing.T) {
	t.Parallel()
	e := newATEnv(t, atOpts{})
	stop := e.run(pipeline.Config{
		Retry: atRetry(3, 1), ClaimTimeout: 2 * time.Second, BusyDelay: 50 * time.Millisecond,
		UnavailableDelay: 50 * time.Millisecond, MaxUnavailableDelay: 400 * time.Millisecond,
		DisableTracing: true, Concurrency: 2,
	}, nil, func(int64, *message.Message) error { return nil })

	// A message every 40 ms for 7 s: 1 s before the outage, 5 s in it, 1 s
	// after.
	var (
		all      []string
		pubDone  = make(chan struct{})
		runsMid  atomic.Int64
		runsLate atomic.Int64
	)
	go func() {
		defer close(pubDone)
		tick := time.NewTicker(40 * time.Millisecond)
		defer tick.Stop()
		end := time.Now().Add(7 * time.Second)
		for time.Now().Before(end) {
			<-tick.C
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
			if err := e.pub.Publish(e.src, msg); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			all = append(all, msg.UUID)
		}
	}()
	rename := func(from, to string) {
		if _, err := e.db.ExecContext(t.Context(), `ALTER TABLE "`+from+`" RENAME TO "`+to+`"`); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Second)
	away := e.claims + "_away"
	rename(e.claims, away)
	outageStart := time.Now()
	time.Sleep(300 * time.Millisecond) // handlers already past their claim finish
	runsMid.Store(e.runs.Load())
	time.Sleep(4700 * time.Millisecond)
	runsLate.Store(e.runs.Load())
	rename(away, e.claims)
	outage := time.Since(outageStart)
	<-pubDone
	e.waitEffects(all)
	dead, pois := e.ended(stop)

	if r := runsLate.Load() - runsMid.Load(); r != 0 {
		t.Errorf("the handler ran %d times while the store could not answer", r)
	}
	if len(dead) != 0 || len(pois) != 0 {
		t.Fatalf("%d dead-lettered, %d poisoned; want none: a store outage is not a handler failure", len(dead), len(pois))
	}
	counts := e.effectCounts()
	for _, id := range all {
		if counts[id] != 1 {
			t.Errorf("message %s done %d times, want once", id, counts[id])
		}
	}
	if len(counts) != len(all) || e.runs.Load() != int64(len(all)) {
		t.Errorf("%d messages with effects, %d handler runs; want %d of each", len(counts), e.runs.Load(), len(all))
	}
	// One line at once, then at most one per 5 s.
	if n := e.log.count("store cannot answer"); n < 1 || n > 1+int(outage/(5*time.Second))+1 {
		t.Errorf("%d outage error lines in %v: %s", n, outage, e.log)
	}
	t.Logf("%d messages, %d published during the outage, %d error lines logged", len(all), int(5*time.Second/(40*time.Millisecond)), e.log.count("store cannot answer"))
}

// countingStore counts the claims of a store.
type countingStore struct {
	dedupe.Store
	claims atomic.Int64
}

func (s *countingStore) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	s.claims.Add(1)
	return s.Store.Claim(ctx, key, ttl)
}

// Item 2: the dedupe middleware alone, as the README shows it, on RabbitMQ,
// which requeues a nacked message at once: a key held by another worker is
// claimed about once per BusyDelay, not tens of thousands of times; once the
// holder releases it the message is done once.
func TestAttemptsBusyKeyWithoutRetry(t *testing.T) {
	t.Parallel()
	e := newATEnv(t, atOpts{})
	store := &countingStore{Store: e.store()}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, BusyDelay: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := amqp.NewSubscriber(e.amqpConfig(), testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: atWait}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("welcome", e.src, sub, func(msg *message.Message) error {
		e.runs.Add(1)
		_, err := e.db.ExecContext(msg.Context(), `INSERT INTO "`+e.effects+`" (msg_id) VALUES ($1)`, msg.UUID)
		return err
	}).AddMiddleware(dd)
	stop := runRouter(t, router, atWait)

	uuid := watermill.NewUUID()
	held, err := e.store().Claim(t.Context(), dedupe.ScopedKey("welcome", uuid), time.Minute) // another worker's live claim
	if err != nil || held.Result != dedupe.Acquired {
		t.Fatalf("hold the key: %+v, %v", held, err)
	}
	if err := e.pub.Publish(e.src, message.NewMessage(uuid, nil)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if n := store.claims.Load(); n < 2 || n > 12 {
		t.Fatalf("%d claims of a busy key in 2s with BusyDelay 200ms; want about 10", n)
	}
	if err := e.store().Release(t.Context(), held); err != nil {
		t.Fatal(err)
	}
	e.waitEffects([]string{uuid})
	dead, pois := e.ended(stop)
	if n := e.effectCounts()[uuid]; n != 1 || e.runs.Load() != 1 || len(dead)+len(pois) != 0 {
		t.Fatalf("effects=%d runs=%d parked=%d; want the message done once, nothing parked", n, e.runs.Load(), len(dead)+len(pois))
	}
}

// Items 3 and 7: a handler returns a permanent error and the poison copy
// cannot be published four times (more than MaxAttempts). The handler runs
// once; the copy lands on the poison queue with the handler's reason, not on
// the dead-letter queue; the store counts one attempt; the spans say
// deferred four times and poisoned once, never retry.
func TestAttemptsFailedPoisonParkIsNotAnAttempt(t *testing.T) {
	t.Parallel()
	e := newATEnv(t, atOpts{})
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	park := &atFailingPublisher{Publisher: e.pub, suffix: ".poison"}
	park.fail.Store(4)
	stop := e.run(pipeline.Config{
		Retry: atRetry(3, 1), NackDelay: 20 * time.Millisecond,
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})},
	}, park, func(int64, *message.Message) error {
		return poison.Permanent(errors.New("order has no customer"))
	})
	ids := e.publish(1)
	deadline := time.Now().Add(atWait)
	for park.tries.Load() < 5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	dead, pois := e.ended(stop)

	if e.runs.Load() != 1 {
		t.Errorf("the handler ran %d times; a permanent failure runs once", e.runs.Load())
	}
	if len(dead) != 0 || len(pois) != 1 {
		t.Fatalf("dead=%d poison=%d; want the copy on the poison queue only", len(dead), len(pois))
	}
	if got := pois[0].Metadata.Get(settle.MetaReason); got != "permanent: order has no customer" || pois[0].UUID != ids[0] {
		t.Errorf("poison copy %s has reason %q; want the handler's", pois[0].UUID, got)
	}
	var attempts int
	if err := e.db.QueryRowContext(t.Context(), `SELECT attempts FROM "`+e.claims+`" WHERE key = $1`, []byte(dedupe.ScopedKey("charge", ids[0]))).Scan(&attempts); err != nil || attempts != 1 {
		t.Errorf("the store counted %d attempts (%v); want 1: failed parks are not attempts", attempts, err)
	}
	outcomes := map[string]int{}
	for _, s := range rec.Ended() {
		if s.Name() == "process "+e.src {
			for _, a := range s.Attributes() {
				if a.Key == attribute.Key("settle.outcome") {
					outcomes[a.Value.AsString()]++
				}
			}
		}
	}
	if len(outcomes) != 2 || outcomes["deferred"] != 4 || outcomes["poisoned"] != 1 {
		t.Errorf("process span outcomes %v; want deferred 4, poisoned 1", outcomes)
	}
}

// Item 4, on a quorum queue: MaxAttempts bounds the handler's runs whatever
// counts them. With the broker's delivery count alone, MaxAttempts 3 with 2
// in-process retries is 3 runs (not 7), and 5 with 1 is 5 (2+2+1); with a
// store too, the store's exact count rules.
func TestAttemptsQuorumQueueBoundsRuns(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name                   string
		maxAttempts, inProcess int
		noStore                bool
	}{
		{"delivery count 3x(1+2)", 3, 2, true},
		{"delivery count 5x(1+1)", 5, 1, true},
		{"store 3x(1+2)", 3, 2, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newATEnv(t, atOpts{quorum: true, noStore: c.noStore})
			stop := e.run(pipeline.Config{Retry: atRetry(c.maxAttempts, c.inProcess), DisableTracing: true}, nil,
				func(int64, *message.Message) error { return errSAFlaky })
			e.publish(1)
			deadline := time.Now().Add(atWait)
			for {
				q, err := e.ch.QueueDeclarePassive(e.dead(), true, false, false, false, nil)
				if err != nil {
					t.Fatal(err)
				}
				if q.Messages == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("not dead-lettered within %v; %d runs", atWait, e.runs.Load())
				}
				time.Sleep(10 * time.Millisecond)
			}
			time.Sleep(100 * time.Millisecond) // a run too many would show now
			dead, _ := e.ended(stop)
			if e.runs.Load() != int64(c.maxAttempts) {
				t.Errorf("the handler ran %d times; MaxAttempts is %d", e.runs.Load(), c.maxAttempts)
			}
			if len(dead) != 1 || dead[0].Metadata.Get(settle.MetaAttempt) != strconv.Itoa(c.maxAttempts) {
				t.Errorf("dead-letter copies %d; want 1 saying %d attempts", len(dead), c.maxAttempts)
			}
		})
	}
}

// Item 6: the dead-letter copy's first failure is the first run's failure,
// not the final refusal; when the process that saw it is gone (the consumer
// restarted before the last attempt), it is the start of the first attempt,
// which the claims table keeps (Claim.FirstAt).
func TestAttemptsFirstFailureIsTheFirst(t *testing.T) {
	t.Parallel()
	cfg := func() pipeline.Config {
		r := atRetry(3, 0)
		r.RedeliveryDelay = 300 * time.Millisecond
		return pipeline.Config{Retry: r, DisableTracing: true}
	}
	t.Run("one process", func(t *testing.T) {
		t.Parallel()
		e := newATEnv(t, atOpts{})
		var firstRun atomic.Int64
		stop := e.run(cfg(), nil, func(run int64, _ *message.Message) error {
			if run == 1 {
				firstRun.Store(time.Now().UnixNano())
			}
			return errSAFlaky
		})
		e.publish(1)
		waitQueue(t, e, e.dead(), 1)
		dead, _ := e.ended(stop)
		first, err1 := time.Parse(time.RFC3339Nano, dead[0].Metadata.Get(settle.MetaFirstFailure))
		last, err2 := time.Parse(time.RFC3339Nano, dead[0].Metadata.Get(settle.MetaLastFailure))
		if err1 != nil || err2 != nil || last.Sub(first) < 500*time.Millisecond || first.Sub(time.Unix(0, firstRun.Load())) > 200*time.Millisecond {
			t.Fatalf("first failure %v, last %v, first run at %v; want the first at the first run, the last two redeliveries later",
				first, last, time.Unix(0, firstRun.Load()))
		}
	})
	t.Run("restart before the last attempt", func(t *testing.T) {
		t.Parallel()
		e := newATEnv(t, atOpts{})
		var firstRun atomic.Int64
		failing := func(run int64, _ *message.Message) error {
			if run == 1 {
				firstRun.Store(time.Now().UnixNano())
			}
			return errSAFlaky
		}
		stop := e.run(cfg(), nil, failing)
		e.publish(1)
		deadline := time.Now().Add(atWait)
		for e.runs.Load() < 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		stop() // the consumer goes away after two attempts
		stop = e.run(cfg(), nil, failing)
		waitQueue(t, e, e.dead(), 1)
		dead, _ := e.ended(stop)
		md := dead[0].Metadata
		if e.runs.Load() != 3 || md.Get(settle.MetaAttempt) != "3" {
			t.Fatalf("runs=%d attempt=%q; want 3", e.runs.Load(), md.Get(settle.MetaAttempt))
		}
		first, err1 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaFirstFailure))
		last, err2 := time.Parse(time.RFC3339Nano, md.Get(settle.MetaLastFailure))
		run1 := time.Unix(0, firstRun.Load())
		if err1 != nil || err2 != nil || first.After(run1) || run1.Sub(first) > 200*time.Millisecond || !last.After(first) {
			t.Fatalf("first failure %q, last %q, first run at %v; want the first attempt's start, just before the first run",
				md.Get(settle.MetaFirstFailure), md.Get(settle.MetaLastFailure), run1)
		}
	})
}

func waitQueue(t *testing.T, e *atEnv, queue string, n int) {
	t.Helper()
	deadline := time.Now().Add(atWait)
	for {
		q, err := e.ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s holds %d messages after %v, want %d", queue, q.Messages, atWait, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Items 1 and 4 under concurrency: two competing consumers, handlers that
// fail at random after random delays, many messages. Every message ends
// exactly one way: done once (one effect) within MaxAttempts runs, or
// dead-lettered after exactly MaxAttempts failed runs with no effect;
// nothing is left on the queue.
func TestAttemptsBoundUnderConcurrency(t *testing.T) {
	t.Parallel()
	const maxAttempts, n = 3, 150
	e := newATEnv(t, atOpts{})
	var mu sync.Mutex
	runs := map[string]int{}
	stop := e.run(pipeline.Config{Retry: atRetry(maxAttempts, 1), Concurrency: 2, BusyDelay: 10 * time.Millisecond, DisableTracing: true}, nil,
		func(_ int64, msg *message.Message) error {
			mu.Lock()
			runs[msg.UUID]++
			mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
			if rand.IntN(2) == 0 {
				return errSAFlaky
			}
			return nil
		})
	ids := e.publish(n)
	deadline := time.Now().Add(atWait)
	for {
		q, err := e.ch.QueueDeclarePassive(e.dead(), true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(e.effectCounts())+q.Messages == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d done, %d dead-lettered of %d within %v", len(e.effectCounts()), q.Messages, n, atWait)
		}
		time.Sleep(20 * time.Millisecond)
	}
	dead, pois := e.ended(stop)
	deadIDs := map[string]bool{}
	for _, d := range dead {
		deadIDs[d.UUID] = true
		if d.Metadata.Get(settle.MetaAttempt) != strconv.Itoa(maxAttempts) {
			t.Errorf("dead-letter %s says %s attempts", d.UUID, d.Metadata.Get(settle.MetaAttempt))
		}
	}
	effects := e.effectCounts()
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		switch {
		case runs[id] > maxAttempts:
			t.Errorf("message %s ran %d times, MaxAttempts is %d", id, runs[id], maxAttempts)
		case deadIDs[id] && (effects[id] != 0 || runs[id] != maxAttempts):
			t.Errorf("dead-lettered message %s: %d effects, %d runs", id, effects[id], runs[id])
		case !deadIDs[id] && effects[id] != 1:
			t.Errorf("message %s: %d effects, not dead-lettered", id, effects[id])
		}
	}
	if len(pois) != 0 || len(dead) != len(deadIDs) {
		t.Errorf("%d poisoned, %d dead-letter copies for %d messages", len(pois), len(dead), len(deadIDs))
	}
	t.Logf("%d messages: %d done, %d dead-lettered", n, len(effects), len(deadIDs))
}

// Without a store or a delivery count, the retry middleware's memory counts
// the runs; a pipeline handler's competing subscriptions (charge, charge#2)
// share one count, so a message failing on whichever of them still runs
// MaxAttempts times in all. (RabbitMQ hands the requeued message to the
// subscriptions in turn; with a count per subscription it ran 8 times.)
func TestAttemptsCompetingSubscriptionsShareTheCount(t *testing.T) {
	t.Parallel()
	const maxAttempts, n = 5, 1
	e := newATEnv(t, atOpts{noStore: true})
	var mu sync.Mutex
	runs := map[string]int{}
	subs := map[string]bool{} // subscriptions that ran a message
	stop := e.run(pipeline.Config{Retry: atRetry(maxAttempts, 0), Concurrency: 2, DisableTracing: true}, nil,
		func(_ int64, msg *message.Message) error {
			mu.Lock()
			runs[msg.UUID]++
			subs[message.HandlerNameFromCtx(msg.Context())] = true
			mu.Unlock()
			return errSAFlaky
		})
	ids := e.publish(n)
	waitQueue(t, e, e.dead(), n)
	dead, _ := e.ended(stop)
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if runs[id] != maxAttempts {
			t.Errorf("message %s ran %d times, want MaxAttempts (%d)", id, runs[id], maxAttempts)
		}
	}
	if len(dead) != n {
		t.Errorf("%d dead-letter copies, want %d", len(dead), n)
	}
	if !subs["charge"] || !subs["charge#2"] {
		t.Errorf("runs on subscriptions %v; the test needs both", subs)
	}
}
