package amqpsub_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strconv"
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
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// fixture is a durable queue with n messages in it, and the watermill-amqp
// configuration that consumes it.
type fixture struct {
	url, queue string
	cfg        amqp.Config
	conn       *amqp091.Connection
}

func newFixture(t *testing.T, n int) *fixture {
	t.Helper()
	f := &fixture{url: testenv.AMQPURL(t), queue: testenv.Name(t, "q")}
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	must(t, err)
	f.cfg = amqp.NewDurableQueueConfig(f.url)
	f.cfg.Marshaler = m
	f.conn, err = amqp091.Dial(f.url)
	must(t, err)
	t.Cleanup(func() { _ = f.conn.Close() })
	ch, err := f.conn.Channel()
	must(t, err)
	_, err = ch.QueueDeclare(f.queue, true, false, false, false, nil)
	must(t, err)
	t.Cleanup(func() {
		if ch, err := f.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(f.queue, false, false, false)
		}
	})
	for i := range n {
		must(t, ch.PublishWithContext(t.Context(), "", f.queue, false, false, amqp091.Publishing{
			MessageId: "m" + strconv.Itoa(i), DeliveryMode: amqp091.Persistent, Body: []byte(`{}`),
		}))
	}
	return f
}

// ready is how many messages wait in the queue (not counting unacked ones).
func (f *fixture) ready(t *testing.T) int {
	t.Helper()
	ch, err := f.conn.Channel()
	must(t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(f.queue, true, false, false, false, nil)
	must(t, err)
	return q.Messages
}

func (f *fixture) subscriber(t *testing.T, inFlight int) *amqpsub.Subscriber {
	t.Helper()
	sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: f.cfg, InFlight: inFlight}, nil)
	must(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// One subscription hands the router up to InFlight deliveries at once, and
// never more: the handler holds every message until eight are inside it, and
// the queue is empty once they all returned.
func TestManyDeliveriesOfOneSubscriptionAtOnce(t *testing.T) {
	t.Parallel()
	const n, inFlight = 64, 8
	f := newFixture(t, n)
	sub := f.subscriber(t, inFlight)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)

	var (
		mu         sync.Mutex
		inside     int
		most       int
		gate       = make(chan struct{})
		gateClosed bool
		handled    atomic.Int64
		wg         sync.WaitGroup
	)
	for range n {
		var msg *message.Message
		select {
		case msg = <-msgs:
		case <-time.After(10 * time.Second):
			t.Fatalf("after %d messages, no more within 10s (at most %d at once)", handled.Load(), most)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			mu.Lock()
			inside++
			most = max(most, inside)
			if inside == inFlight && !gateClosed {
				close(gate) // the first eight are in: let them all go
				gateClosed = true
			}
			mu.Unlock()
			select {
			case <-gate:
			case <-time.After(10 * time.Second):
			}
			mu.Lock()
			inside--
			mu.Unlock()
			handled.Add(1)
			msg.Ack()
		}()
	}
	wg.Wait()
	if most != inFlight {
		t.Errorf("at most %d deliveries of one subscription were in the handler at once, want %d", most, inFlight)
	}
	must(t, sub.Close())
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages back in the queue after every one was acked", r)
	}
}

// Acks leave in as few frames as possible, but a nacked delivery is never
// covered by the ack of later ones: messages answered in random order, a
// third of them nacked on their first delivery, each come back until acked,
// and the queue is empty at the end.
func TestNackedDeliveriesComeBackAmongAckedOnes(t *testing.T) {
	t.Parallel()
	const n = 300
	f := newFixture(t, n)
	sub := f.subscriber(t, 16)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)

	var (
		mu       sync.Mutex
		seen     = map[string]int{} // deliveries per message
		acked    = map[string]int{}
		pending  sync.WaitGroup
		finished = make(chan struct{})
	)
	deadline := time.After(60 * time.Second)
	for loop := true; loop; {
		var msg *message.Message
		select {
		case msg = <-msgs:
		case <-finished:
			loop = false
			continue
		case <-deadline:
			mu.Lock()
			t.Fatalf("after 60s %d of %d messages acked", len(acked), n)
		}
		pending.Add(1)
		go func() {
			defer pending.Done()
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
			id, _ := strconv.Atoi(msg.UUID[1:])
			mu.Lock()
			seen[msg.UUID]++
			nack := id%3 == 0 && seen[msg.UUID] == 1
			if !nack {
				acked[msg.UUID]++
				if len(acked) == n && acked[msg.UUID] == 1 {
					close(finished)
				}
			}
			mu.Unlock()
			if nack {
				msg.Nack()
			} else {
				msg.Ack()
			}
		}()
	}
	pending.Wait()
	must(t, sub.Close())
	for i := range n {
		id := "m" + strconv.Itoa(i)
		want := 1
		if i%3 == 0 {
			want = 2
		}
		if seen[id] < want {
			t.Errorf("%s delivered %d times, want at least %d", id, seen[id], want)
		}
	}
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages back in the queue after every one was acked", r)
	}
}

// Messages the router acked before Close are acked to the broker, not
// handed back: sixteen are received and acked, the subscriber is closed at
// once, and only the messages never received are left in the queue.
func TestAckedBeforeCloseStayAcked(t *testing.T) {
	t.Parallel()
	const n, inFlight = 40, 16
	f := newFixture(t, n)
	sub := f.subscriber(t, inFlight)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)
	for range inFlight {
		select {
		case msg := <-msgs:
			msg.Ack()
		case <-time.After(10 * time.Second):
			t.Fatal("no message within 10s")
		}
	}
	must(t, sub.Close())
	if r := f.ready(t); r != n-inFlight {
		t.Errorf("%d messages in the queue after %d of %d were acked, want %d", r, inFlight, n, n-inFlight)
	}
}

// With pipeline, one subscription fills a batch: Concurrency 1, InFlight 16,
// and batches of more than one message form; every message is charged once.
func TestBatchesFillFromOneSubscription(t *testing.T) {
	t.Parallel()
	const n = 400
	f := newFixture(t, n)
	d := testenv.SQLite(t)
	_, err := d.ExecContext(t.Context(), "CREATE TABLE fx (msg TEXT NOT NULL PRIMARY KEY)")
	must(t, err)
	store, err := dedupe.NewSQLStore(d.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, d)})
	must(t, err)
	sub := f.subscriber(t, 16)

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: discard{}, Store: store, DisableTracing: true})
	must(t, err)
	var biggest atomic.Int64
	_, err = pipeline.HandleBatchTx(p, "charge", f.queue, sub, pipeline.TxConfig[*sql.Tx]{DB: d.Driver(), Batch: pipeline.BatchConfig{MaxSize: 16, MaxWait: 20 * time.Millisecond}},
		func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			for {
				old := biggest.Load()
				if int64(len(msgs)) <= old || biggest.CompareAndSwap(old, int64(len(msgs))) {
					break
				}
			}
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, "INSERT INTO fx (msg) VALUES (?)", m.UUID); err != nil {
					return err
				}
			}
			return nil
		})
	must(t, err)
	runRouter(t, router, func() bool {
		var c int
		must(t, d.QueryRowContext(t.Context(), "SELECT count(*) FROM fx").Scan(&c))
		return c == n
	})
	if b := biggest.Load(); b < 8 {
		t.Errorf("the largest batch held %d messages; one subscription with 16 in flight should fill batches", b)
	}
	must(t, sub.Close())
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages back in the queue after every one was charged", r)
	}
}

// When the broker closes the connection, the subscription reconnects and
// goes on; what was in flight comes back and nothing is lost.
func TestConsumingGoesOnAfterTheConnectionIsClosed(t *testing.T) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		testenv.Require(t, "SETTLE_RABBITMQCTL") // skips, or fails in CI, with the reason
	}
	const n = 600
	f := newFixture(t, n)
	// A connection name of its own, so that only this connection is closed.
	sub, name := f.namedSubscriber(t, 16, nil)
	msgs, err := sub.Subscribe(t.Context(), f.queue)
	must(t, err)

	var mu sync.Mutex
	done := map[string]bool{}
	var killed atomic.Bool
	deadline := time.After(30 * time.Second)
	for {
		mu.Lock()
		count := len(done)
		mu.Unlock()
		if count == n {
			break
		}
		if count >= n/3 && killed.CompareAndSwap(false, true) {
			closeConnection(t, name)
		}
		var msg *message.Message
		select {
		case msg = <-msgs:
		case <-time.After(200 * time.Millisecond):
			continue
		case <-deadline:
			t.Fatalf("after 30s %d of %d messages handled (connection closed: %v)", count, n, killed.Load())
		}
		go func() {
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
			mu.Lock()
			done[msg.UUID] = true
			mu.Unlock()
			msg.Ack()
		}()
	}
	if !killed.Load() {
		t.Fatal("the connection was never closed")
	}
	// The acks of the last messages may still be on their way.
	time.Sleep(500 * time.Millisecond)
	must(t, sub.Close())
	if r := f.ready(t); r != 0 {
		t.Errorf("%d messages back in the queue after every one was handled", r)
	}
}

// A batch handler on PostgreSQL fed by one subscription, every message
// published twice, and the subscriber's connection closed by the broker
// while batches are in flight: each message's effect is written once (the
// effect table's key refuses a second one) and none is missing.
func TestBatchesOnPostgresThroughAClosedConnection(t *testing.T) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		testenv.Require(t, "SETTLE_RABBITMQCTL")
	}
	const n = 500
	f := newFixture(t, 0)
	ch, err := f.conn.Channel()
	must(t, err)
	for i := range 2 * n {
		must(t, ch.PublishWithContext(t.Context(), "", f.queue, false, false, amqp091.Publishing{
			MessageId: "m" + strconv.Itoa(i%n), DeliveryMode: amqp091.Persistent, Body: []byte(`{}`),
		}))
	}
	d := testenv.Postgres(t)
	fx := testenv.Name(t, "fx")
	_, err = d.ExecContext(t.Context(), "CREATE TABLE "+fx+" (msg TEXT NOT NULL PRIMARY KEY)")
	must(t, err)
	t.Cleanup(func() { _, _ = d.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+fx) })
	store, err := dedupe.NewSQLStore(d.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, d)})
	must(t, err)
	sub, name := f.namedSubscriber(t, 16, nil)

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: discard{}, Store: store, DisableTracing: true, BusyDelay: 10 * time.Millisecond})
	must(t, err)
	var runs atomic.Int64
	_, err = pipeline.HandleBatchTx(p, "charge", f.queue, sub, pipeline.TxConfig[*sql.Tx]{DB: d.Driver(), Batch: pipeline.BatchConfig{MaxSize: 16}},
		func(ctx context.Context, tx *sql.Tx, msgs []*message.Message, _ message.Publisher) error {
			runs.Add(1)
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, "INSERT INTO "+fx+" (msg) VALUES ($1)", m.UUID); err != nil {
					return err
				}
			}
			return nil
		})
	must(t, err)
	var closed atomic.Bool
	count := func() int {
		var c int
		must(t, d.QueryRowContext(t.Context(), "SELECT count(*) FROM "+fx).Scan(&c))
		return c
	}
	runRouter(t, router, func() bool {
		c := count()
		if c >= n/3 && closed.CompareAndSwap(false, true) {
			closeConnection(t, name)
		}
		return c == n
	})
	if !closed.Load() {
		t.Fatal("the connection was never closed")
	}
	must(t, sub.Close())
	if c := count(); c != n {
		t.Errorf("%d effects for %d messages", c, n)
	}
	t.Logf("%d batch runs for %d deliveries", runs.Load(), 2*n)
}

// closeConnection has the broker close the client connection named name.
func closeConnection(t *testing.T, name string) {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "rabbitmqctl", "-q", "list_connections", "pid", "client_properties").Output()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v", err)
	}
	for line := range strings.Lines(string(out)) {
		if strings.Contains(line, `"connection_name","`+name+`"`) {
			pid, _, _ := strings.Cut(line, "\t")
			if out, err := exec.CommandContext(t.Context(), "rabbitmqctl", "close_connection", pid, "settle test").CombinedOutput(); err != nil {
				t.Fatalf("rabbitmqctl close_connection: %v: %s", err, out)
			}
			return
		}
	}
	t.Fatalf("no connection named %s in rabbitmqctl list_connections", name)
}

func runRouter(t *testing.T, router *message.Router, done func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- router.Run(ctx) }()
	defer func() {
		cancel()
		must(t, router.Close())
		must(t, <-errc)
	}()
	<-router.Running()
	deadline := time.Now().Add(60 * time.Second)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatal("not done within 60s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// discard is a publisher for the parking topics that no message reaches.
type discard struct{}

func (discard) Publish(topic string, msgs ...*message.Message) error {
	return fmt.Errorf("unexpected publish to %s", topic)
}
func (discard) Close() error { return nil }
