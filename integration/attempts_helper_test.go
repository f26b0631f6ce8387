package integration_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// atWait bounds every wait of the attempt-model tests.
const atWait = 30 * time.Second

// atEnv is a pipeline on RabbitMQ with its claims (when there is a store)
// and the handler's effects in PostgreSQL: what a user runs. The pipeline's
// default parking topics, <src>.dead_letter and <src>.poison, are queues.
type atEnv struct {
	t         *testing.T
	url       string
	quorum    bool
	db        testenv.DB
	src       string
	effects   string // table: one row per successful handler run
	claims    string // the claims table; "" without a store
	ch        *amqp091.Channel
	marshaler amqpmarshal.Marshaler
	pub       *amqp.Publisher
	log       *countingLogger
	runs      atomic.Int64 // handler runs
}

type atOpts struct {
	quorum  bool
	noStore bool
}

func newATEnv(t *testing.T, o atOpts) *atEnv {
	t.Helper()
	e := &atEnv{t: t, url: testenv.AMQPURL(t), quorum: o.quorum, db: testenv.Postgres(t), src: testenv.Name(t, "at"), log: &countingLogger{}}
	if !o.noStore {
		e.claims = testenv.DedupeTable(t, e.db)
	}
	e.effects = testenv.Name(t, "at_effects")
	if _, err := e.db.ExecContext(t.Context(), `CREATE TABLE "`+e.effects+`" (msg_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+e.effects+`"`) })
	m, err := amqpmarshal.New(amqpmarshal.Config{QuorumQueue: o.quorum})
	if err != nil {
		t.Fatal(err)
	}
	e.marshaler = m
	conn, err := amqp091.Dial(e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if e.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range e.queues() {
			_, _ = e.ch.QueueDelete(q, false, false, false)
		}
	})
	for _, q := range e.queues() {
		// The pipeline declares the parking queues with the subscriber's
		// configuration before each copy, so they are declared here as the
		// subscriber would.
		args := e.srcArgs()
		if _, err := e.ch.QueueDeclare(q, true, false, false, false, args); err != nil {
			t.Fatalf("declare queue %s: %v", q, err)
		}
	}
	e.pub, err = amqp.NewPublisher(e.amqpConfig(), testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.pub.Close() })
	return e
}

func (e *atEnv) dead() string   { return e.src + ".dead_letter" }
func (e *atEnv) poison() string { return e.src + ".poison" }
func (e *atEnv) queues() []string {
	return []string{e.src, e.dead(), e.poison()}
}

func (e *atEnv) srcArgs() amqp091.Table {
	if e.quorum {
		return amqp091.Table{"x-queue-type": "quorum"}
	}
	return nil
}

func (e *atEnv) amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(e.url)
	cfg.Marshaler = e.marshaler
	cfg.Queue.Arguments = e.srcArgs()
	cfg.Publish.ConfirmDelivery = true
	return cfg
}

// store returns a store on the claims table.
func (e *atEnv) store() *dedupe.SQLStore[*sql.Tx] {
	s, err := dedupe.NewSQLStore(e.db.Driver(), dedupe.SQLConfig{Table: e.claims})
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// run starts a router with one pipeline handler on the source queue, whose
// parked copies go through park (the RabbitMQ publisher when nil). The
// handler records an effect row when fn succeeds. It returns the function
// that stops the router.
func (e *atEnv) run(cfg pipeline.Config, park message.Publisher, fn func(run int64, msg *message.Message) error) (stop func()) {
	t := e.t
	t.Helper()
	sub, err := amqp.NewSubscriber(e.amqpConfig(), testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: atWait}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Publisher = park
	if cfg.Publisher == nil {
		cfg.Publisher = e.pub
	}
	cfg.Logger = e.log
	if e.claims != "" && cfg.Store == nil {
		cfg.Store = e.store()
	}
	p, err := pipeline.New(router, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Handle("charge", e.src, sub, func(msg *message.Message) error {
		if err := fn(e.runs.Add(1), msg); err != nil {
			return err
		}
		_, err := e.db.ExecContext(msg.Context(), `INSERT INTO "`+e.effects+`" (msg_id) VALUES ($1)`, msg.UUID)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return runRouter(t, router, atWait)
}

// publish puts n new messages on the source queue and returns their UUIDs.
func (e *atEnv) publish(n int) []string {
	e.t.Helper()
	var ids []string
	for range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
		if err := e.pub.Publish(e.src, msg); err != nil {
			e.t.Fatalf("publish: %v", err)
		}
		ids = append(ids, msg.UUID)
	}
	return ids
}

// effectCounts returns the effect rows per message.
func (e *atEnv) effectCounts() map[string]int {
	e.t.Helper()
	rows, err := e.db.QueryContext(e.t.Context(), `SELECT msg_id, count(*) FROM "`+e.effects+`" GROUP BY msg_id`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			e.t.Fatal(err)
		}
		got[id] = n
	}
	return got
}

// waitEffects polls until every message of ids has an effect.
func (e *atEnv) waitEffects(ids []string) {
	e.t.Helper()
	deadline := time.Now().Add(atWait)
	for {
		got := e.effectCounts()
		done := 0
		for _, id := range ids {
			if got[id] > 0 {
				done++
			}
		}
		if done == len(ids) {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d of %d messages done within %v", done, len(ids), atWait)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ended stops the router (stop), checks that the source queue is empty, and
// returns what the parking queues hold.
func (e *atEnv) ended(stop func()) (dead, poisoned []*message.Message) {
	e.t.Helper()
	time.Sleep(300 * time.Millisecond) // the last delivery's ack follows its effect or parked copy
	stop()
	if n := saQueueAfterConsumersLeft(e.t, e.ch, e.src, e.srcArgs()); n != 0 {
		e.t.Errorf("source queue holds %d messages after the router closed, want 0", n)
	}
	return saDrain(e.t, e.ch, e.marshaler, e.dead()), saDrain(e.t, e.ch, e.marshaler, e.poison())
}

// countingLogger counts the error lines settle logs, by message.
type countingLogger struct {
	mu     sync.Mutex
	errors map[string]int
}

func (l *countingLogger) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.errors == nil {
		l.errors = map[string]int{}
	}
	l.errors[msg]++
}
func (l *countingLogger) Info(string, watermill.LogFields)  {}
func (l *countingLogger) Debug(string, watermill.LogFields) {}
func (l *countingLogger) Trace(string, watermill.LogFields) {}
func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}

func (l *countingLogger) count(substr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for m, c := range l.errors {
		if strings.Contains(m, substr) {
			n += c
		}
	}
	return n
}

func (l *countingLogger) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fmt.Sprint(l.errors)
}

// atFailingPublisher fails its first fail publishes to topics ending in
// suffix, and counts them.
type atFailingPublisher struct {
	message.Publisher
	suffix string
	fail   atomic.Int64
	tries  atomic.Int64
}

func (p *atFailingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if strings.HasSuffix(topic, p.suffix) {
		p.tries.Add(1)
		if p.fail.Add(-1) >= 0 {
			return fmt.Errorf("publish to %s refused (injected)", topic)
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *atFailingPublisher) Close() error { return nil }
