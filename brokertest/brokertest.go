package brokertest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// Harness is what the suite needs from one broker, for one test. setup
// builds a new one for every case; what it opens it closes itself with
// t.Cleanup.
type Harness struct {
	// Publisher publishes the suite's messages and settle's dead-letter and
	// poison copies, to any topic. Publish must return only once the broker
	// has stored the message (publisher confirms on RabbitMQ, the
	// JetStream ack on NATS). Required.
	Publisher message.Publisher
	// NewSubscriber returns a new subscriber on a connection of its own.
	// Subscribed to the same topic, two of them are competing consumers of
	// one consumer group (RabbitMQ: one queue; JetStream: one durable
	// consumer and queue group; Redis: one consumer group, a consumer name
	// each; SQL: one consumer group). The group must be named the same by
	// every call of setup, in this process and in another (the kill case
	// runs setup again in a child process, whose subscriber must join the
	// group of the parent's): a fixed name does, since the suite's topics
	// are its own. The suite closes every subscriber it makes (Close may be
	// called twice). Required.
	NewSubscriber func(t *testing.T) message.Subscriber
	// DB is the database of settle's claims store and of the suite's effect
	// rows (one row per committed handler effect); the suite creates its
	// tables in it, named for the case, and drops them at the end. Required.
	DB *sql.DB
	// Dialect is DB's dialect. Required.
	Dialect sqldb.Dialect
	// Backlog reports how many messages of topic the harness's consumer
	// group has not acked: those waiting, and those delivered but neither
	// acked nor returned (RabbitMQ: the queue's messages; JetStream: the
	// consumer's NumPending plus NumAckPending; Redis: the group's pending
	// entries plus those not yet delivered; SQL: the rows past the group's
	// acked offset). The suite calls it once every subscriber of topic is
	// closed and expects 0 at the end of every case: nothing settled may be
	// left unacked. Nil skips that check, with a log line; only a broker
	// that keeps no backlog outside the process (GoChannel) should leave
	// it nil.
	Backlog func(ctx context.Context, topic string) (int, error)
	// DropTopic, if set, is called when a case ends for each of its topics
	// (its own, its dead-letter and its poison topic), once its subscribers
	// are closed, to delete what the broker keeps for it: a queue, a
	// stream, tables. The suite's topic names are its own and fresh per
	// case. An error fails the case.
	DropTopic func(ctx context.Context, topic string) error
	// FanOut says that every subscription of a topic receives every
	// message (GoChannel): the suite's "competing" consumers then both
	// receive each message, which the duplicate cases still use (two
	// deliveries of one message at once); nothing is skipped for it.
	FanOut bool
	// InProcess says that the broker lives in the test process
	// (GoChannel), so that no message outlives a killed consumer: the kill
	// case is skipped.
	InProcess bool
	// Logger, if set, receives the logs of the suite's routers and settle's
	// middleware. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (h Harness) validate() error {
	switch {
	case h.Publisher == nil:
		return errors.New("brokertest: Harness.Publisher is required")
	case h.NewSubscriber == nil:
		return errors.New("brokertest: Harness.NewSubscriber is required")
	case h.DB == nil:
		return errors.New("brokertest: Harness.DB is required")
	case h.Dialect == "":
		return errors.New("brokertest: Harness.Dialect is required")
	}
	return nil
}

// The suite's settings: short, so that the whole suite on a real broker
// takes seconds per case.
const (
	// handlerName is the pipeline handler of every case (its dedupe scope).
	handlerName = "effect"
	// maxAttempts is the suite's RetryConfig.MaxAttempts.
	maxAttempts = 3
	// claimTimeout is the pipeline's ClaimTimeout.
	claimTimeout = 3 * time.Second
	// wait bounds every wait for a condition; a case ends as soon as its
	// conditions hold.
	wait = 60 * time.Second
	// settleGrace is how long a case keeps watching after its conditions
	// held, for a delivery or copy that should not come (a second
	// dead-letter copy, a run past MaxAttempts).
	settleGrace = time.Second
)

// payload is the body of the suite's messages.
type payload struct {
	Order string `json:"order"`
}

// Run runs the suite. Each case runs in parallel with the others, with its
// own topics and tables, and calls setup for a fresh Harness.
//
// The kill case re-executes the test binary (os.Args[0]) with -test.run
// naming the test that called Run, and an environment variable that makes
// Run, in that process, call setup and consume as the case's child instead
// of running the suite. The test must therefore reach Run the same way
// when run alone (the usual case: a TestX that calls Run, or a subtest of
// it).
func Run(t *testing.T, setup func(t *testing.T) Harness) {
	t.Helper()
	if spec, ok := childSpecFrom(os.Getenv(childEnv)); ok {
		if spec.Test != t.Name() {
			t.Skipf("brokertest: this process is the kill case's child of %s", spec.Test)
		}
		runChild(t, setup, spec)
		return
	}
	parent := t.Name()
	cases := []struct {
		name string
		fn   func(f *fixture)
	}{
		{"DuplicateSequential/tx", func(f *fixture) { testDuplicateSequential(f, modeTx) }},
		{"DuplicateSequential/plain", func(f *fixture) { testDuplicateSequential(f, modePlain) }},
		{"DuplicateConcurrent/tx", func(f *fixture) { testDuplicateConcurrent(f, modeTx) }},
		{"DuplicateConcurrent/plain", func(f *fixture) { testDuplicateConcurrent(f, modePlain) }},
		{"FailedFirstRunRedone/tx", func(f *fixture) { testFailedFirstRun(f, modeTx) }},
		{"FailedFirstRunRedone/plain", func(f *fixture) { testFailedFirstRun(f, modePlain) }},
		{"MaxAttemptsThenDeadLetter", testMaxAttempts},
		{"PoisonNeverRuns", testPoison},
		{"BusyKeyDeferred", testBusyKey},
		{"KillMidHandler", testKill},
		{"StopMidHandler", testStopMidHandler},
		{"BacklogDrained", testBacklogDrained},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, setup(t), parent)
			c.fn(f)
		})
	}
}

// mode is how the case's handler is added to the pipeline.
type mode int

const (
	modeTx    mode = iota // pipeline.HandleTx: the effect row in the claim's transaction
	modePlain             // Pipeline.Handle: the effect row written on its own, then the key confirmed
)

// fixture is one case: its harness, names, tables, and what its consumers
// saw.
type fixture struct {
	t      *testing.T
	h      Harness
	parent string // name of the test that called Run
	topic  string
	dead   string // dead-letter topic
	poison string
	claims string // claims table
	fx     string // effects table
	store  *dedupe.SQLStore[*sql.Tx]

	mu       sync.Mutex
	behave   func(ctx context.Context, uuid string, run int) error
	runs     map[string]int // handler runs per message UUID
	acks     map[string]int // deliveries acked, per UUID
	nacks    map[string]int // deliveries nacked (retry or deferred), per UUID
	inFlight map[string]int
	overlap  map[string]int // most deliveries of one UUID in flight at once
}

// newBase returns a fresh base name for a case's topics and tables: short
// enough for every broker's and database's limits with the suffixes the
// suite and the brokers add (watermill-sql's "watermill_offsets_" prefix
// and the "_dead_letter" suffix stay under 63 bytes).
func newBase() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return "bt_" + hex.EncodeToString(b[:])
}

func newFixture(t *testing.T, h Harness, parent string) *fixture {
	t.Helper()
	if err := h.validate(); err != nil {
		t.Fatal(err)
	}
	if h.Logger == nil {
		h.Logger = watermill.NopLogger{}
	}
	base := newBase()
	f := &fixture{
		t: t, h: h, parent: parent,
		topic: base, dead: base + "_dead_letter", poison: base + "_poison",
		claims: base + "_claims", fx: base + "_fx",
		runs: map[string]int{}, acks: map[string]int{}, nacks: map[string]int{},
		inFlight: map[string]int{}, overlap: map[string]int{},
	}
	f.createTables()
	if h.DropTopic != nil {
		t.Cleanup(func() {
			for _, topic := range []string{f.topic, f.dead, f.poison} {
				if err := h.DropTopic(context.Background(), topic); err != nil {
					t.Errorf("brokertest: Harness.DropTopic(%q): %v", topic, err)
				}
			}
		})
	}
	return f
}

// createTables creates the case's claims and effects tables and drops them
// when the case ends.
func (f *fixture) createTables() {
	t := f.t
	store, err := dedupe.NewSQLStore(sqldb.Std(f.h.DB, f.h.Dialect), dedupe.SQLConfig{Table: f.claims})
	if err != nil {
		t.Fatal(err)
	}
	f.store = store
	ddl := append(store.Schema(), "CREATE TABLE "+f.fx+" (msg_id VARCHAR(64) NOT NULL, pid INTEGER NOT NULL)")
	for _, q := range ddl {
		if _, err := f.h.DB.ExecContext(t.Context(), q); err != nil {
			t.Fatalf("brokertest: create tables: %v", err)
		}
	}
	t.Cleanup(func() {
		for _, table := range []string{f.fx, f.claims} {
			_, _ = f.h.DB.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table)
		}
	})
}

// ph is the n-th placeholder of the dialect.
func ph(d sqldb.Dialect, n int) string {
	if d == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

// effects counts the committed effect rows of uuid.
func (f *fixture) effects(uuid string) int {
	f.t.Helper()
	var n int
	err := f.h.DB.QueryRowContext(context.Background(),
		"SELECT COUNT(*) FROM "+f.fx+" WHERE msg_id = "+ph(f.h.Dialect, 1), uuid).Scan(&n)
	if err != nil {
		f.t.Fatalf("brokertest: count effects: %v", err)
	}
	return n
}

// effectsBy counts the committed effect rows of uuid written by process pid.
func (f *fixture) effectsBy(uuid string, pid int) int {
	f.t.Helper()
	var n int
	err := f.h.DB.QueryRowContext(context.Background(),
		"SELECT COUNT(*) FROM "+f.fx+" WHERE msg_id = "+ph(f.h.Dialect, 1)+" AND pid = "+ph(f.h.Dialect, 2), uuid, pid).Scan(&n)
	if err != nil {
		f.t.Fatalf("brokertest: count effects: %v", err)
	}
	return n
}

// setBehave sets what the handler does after its effect (tx mode) or
// before it (plain mode) on each run: an error fails the run.
func (f *fixture) setBehave(fn func(ctx context.Context, uuid string, run int) error) {
	f.mu.Lock()
	f.behave = fn
	f.mu.Unlock()
}

// noteRun counts a handler run of uuid and returns its number and the
// case's behaviour.
func (f *fixture) noteRun(uuid string) (int, func(ctx context.Context, uuid string, run int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.runs[uuid]++
	return f.runs[uuid], f.behave
}

func (f *fixture) count(m map[string]int, uuid string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return m[uuid]
}

// observe is the outermost middleware of the case's routers: it records
// how each delivery ended at the broker (nil is an ack, an error a nack)
// and how many deliveries of one message were in flight at once.
func (f *fixture) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		f.mu.Lock()
		f.inFlight[msg.UUID]++
		f.overlap[msg.UUID] = max(f.overlap[msg.UUID], f.inFlight[msg.UUID])
		f.mu.Unlock()
		out, err := h(msg)
		f.mu.Lock()
		f.inFlight[msg.UUID]--
		if err == nil {
			f.acks[msg.UUID]++
		} else {
			f.nacks[msg.UUID]++
		}
		f.mu.Unlock()
		return out, err
	}
}

// pipelineConfig is the suite's pipeline configuration: every failure goes
// back through the broker (no in-process retries), with short delays.
func pipelineConfig(h Harness, dead, poison string) pipeline.Config {
	return pipeline.Config{
		Publisher:        h.Publisher,
		DeadLetterTopic:  dead,
		PoisonTopic:      poison,
		ClaimTimeout:     claimTimeout,
		BusyDelay:        100 * time.Millisecond,
		UnavailableDelay: 100 * time.Millisecond,
		NackDelay:        100 * time.Millisecond,
		DisableTracing:   true,
		Logger:           h.Logger,
		Retry: middleware.RetryConfig{
			MaxAttempts:        maxAttempts,
			NoInProcessRetries: true,
			InitialInterval:    10 * time.Millisecond,
			MaxInterval:        100 * time.Millisecond,
			RedeliveryDelay:    50 * time.Millisecond,
		},
	}
}

// consumer is one router with the settle stack on one subscriber.
type consumer struct {
	router *message.Router
	sub    message.Subscriber
	done   chan error
	once   sync.Once
}

// startConsumer starts a router consuming the case's topic with the
// pipeline, in mode, and returns once it runs. The case's observer is its
// outermost middleware. It is stopped when the case ends, if not before.
func (f *fixture) startConsumer(m mode) *consumer {
	t := f.t
	t.Helper()
	c, err := buildConsumer(t, f.h, f.observe, f.store, f.topic, f.dead, f.poison, m, f.handler(m, os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.stop(t) })
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	return c
}

// handlers is a case's handler in both modes; buildConsumer uses the one
// of its mode.
type handlers struct {
	tx    pipeline.TxFunc[*sql.Tx]
	plain message.NoPublishHandlerFunc
}

func buildConsumer(t *testing.T, h Harness, observe message.HandlerMiddleware, store *dedupe.SQLStore[*sql.Tx], topic, dead, poison string, m mode, hs handlers) (*consumer, error) {
	sub := h.NewSubscriber(t)
	c := &consumer{sub: sub, done: make(chan error, 1)}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, h.Logger)
	if err != nil {
		return nil, err
	}
	c.router = r
	if observe != nil {
		r.AddMiddleware(observe)
	}
	cfg := pipelineConfig(h, dead, poison)
	cfg.Store = store
	p, err := pipeline.New(r, cfg)
	if err != nil {
		return nil, err
	}
	switch m {
	case modeTx:
		_, err = pipeline.HandleTx(p, handlerName, topic, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(h.DB, h.Dialect)}, hs.tx)
	default:
		_, err = p.Handle(handlerName, topic, sub, hs.plain)
	}
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	return c, nil
}

// start runs the router and waits until it runs.
func (c *consumer) start() error {
	go func() { c.done <- c.router.Run(context.Background()) }()
	select {
	case <-c.router.Running():
		return nil
	case err := <-c.done:
		c.done <- err
		return fmt.Errorf("brokertest: router stopped before running: %v", err)
	case <-time.After(wait):
		return errors.New("brokertest: router did not start")
	}
}

// stop closes the router (which closes its subscriber) and waits for it.
func (c *consumer) stop(t *testing.T) {
	c.once.Do(func() {
		if err := c.router.Close(); err != nil {
			t.Errorf("brokertest: close router: %v", err)
		}
		select {
		case err := <-c.done:
			if err != nil {
				t.Errorf("brokertest: router run: %v", err)
			}
		case <-time.After(wait):
			t.Error("brokertest: router did not stop")
		}
		if err := c.sub.Close(); err != nil {
			t.Errorf("brokertest: close subscriber: %v", err)
		}
	})
}

// handler returns the case's handler in both modes; pid is written in each
// effect row.
func (f *fixture) handler(m mode, pid int) handlers {
	insert := "INSERT INTO " + f.fx + " (msg_id, pid) VALUES (" + ph(f.h.Dialect, 1) + ", " + ph(f.h.Dialect, 2) + ")"
	return handlers{
		tx: pipeline.TypedTx(nil, func(ctx context.Context, tx *sql.Tx, msg pipeline.Message[payload], _ message.Publisher) error {
			run, behave := f.noteRun(msg.UUID)
			if _, err := tx.ExecContext(ctx, insert, msg.UUID, pid); err != nil {
				return err
			}
			if behave != nil {
				return behave(ctx, msg.UUID, run)
			}
			return nil
		}),
		plain: pipeline.Typed(nil, func(ctx context.Context, msg pipeline.Message[payload]) error {
			run, behave := f.noteRun(msg.UUID)
			if behave != nil {
				if err := behave(ctx, msg.UUID, run); err != nil {
					return err
				}
			}
			_, err := f.h.DB.ExecContext(ctx, insert, msg.UUID, pid)
			return err
		}),
	}
}

// publish publishes one message of uuid with payload body on the case's
// topic.
func (f *fixture) publish(uuid string, body []byte) {
	f.t.Helper()
	if err := f.h.Publisher.Publish(f.topic, message.NewMessage(uuid, body)); err != nil {
		f.t.Fatalf("brokertest: publish: %v", err)
	}
}

func order(uuid string) []byte { return []byte(`{"order":"` + uuid + `"}`) }

// waitFor polls cond until it holds, or fails the case after wait with
// what cond last reported.
func (f *fixture) waitFor(what string, cond func() (bool, string)) {
	f.t.Helper()
	deadline := time.Now().Add(wait)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("brokertest: %s: not within %v; %s", what, wait, state)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// state describes what the case saw of uuid, for failure messages.
func (f *fixture) state(uuid string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return fmt.Sprintf("message %s: %d runs, %d acks, %d nacks", uuid, f.runs[uuid], f.acks[uuid], f.nacks[uuid])
}

// drained checks, once every consumer of the case is stopped, that the
// broker holds nothing of the case's topic for the consumer group.
func (f *fixture) drained(consumers ...*consumer) {
	f.t.Helper()
	for _, c := range consumers {
		c.stop(f.t)
	}
	if f.h.Backlog == nil {
		f.t.Log("brokertest: Harness.Backlog is nil: the broker's backlog is not checked")
		return
	}
	var n int
	var err error
	f.waitFor("the broker's backlog of "+f.topic+" drained", func() (bool, string) {
		n, err = f.h.Backlog(context.Background(), f.topic)
		return err == nil && n == 0, fmt.Sprintf("backlog %d, error %v", n, err)
	})
}

// collector counts the messages on a parking topic (dead-letter or
// poison), by the UUID of the message each is a copy of.
type collector struct {
	mu     sync.Mutex
	copies map[string]int
	reason map[string]string
	cancel context.CancelFunc
	done   chan struct{}
	sub    message.Subscriber
}

// collect subscribes to topic with a new subscriber of the harness and
// acks and counts every message on it until the case ends.
func (f *fixture) collect(topic string) *collector {
	t := f.t
	t.Helper()
	sub := f.h.NewSubscriber(t)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		cancel()
		_ = sub.Close()
		t.Fatalf("brokertest: subscribe to %s: %v", topic, err)
	}
	c := &collector{copies: map[string]int{}, reason: map[string]string{}, cancel: cancel, done: make(chan struct{}), sub: sub}
	go func() {
		defer close(c.done)
		for msg := range ch {
			c.mu.Lock()
			orig := msg.Metadata.Get(settle.MetaOriginalUUID)
			c.copies[orig]++
			c.reason[orig] = msg.Metadata.Get(settle.MetaReason)
			c.mu.Unlock()
			msg.Ack()
		}
	}()
	t.Cleanup(func() {
		cancel()
		if err := sub.Close(); err != nil {
			t.Errorf("brokertest: close subscriber of %s: %v", topic, err)
		}
		select {
		case <-c.done:
		case <-time.After(wait):
			t.Errorf("brokertest: subscription to %s did not end", topic)
		}
	})
	return c
}

func (c *collector) count(uuid string) (int, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.copies[uuid], c.reason[uuid]
}
