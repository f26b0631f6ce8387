package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/deliverymark"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// A worker frozen with a message (SIGSTOP, a long GC pause, a partition)
// while the broker redelivers it to another worker, whose delivery count
// leaves no attempt: the other worker finds the key not confirmed and
// dead-letters the message without a run. When the frozen worker wakes it
// must not do the work: the message's fate is already dead-lettered, and an
// effect too would be two fates (a replay of the copy would even do it
// twice). In the one-statement and batch modes, which write their keys in
// their own transactions and count attempts with the broker's delivery
// count, the refusal is committed before the copy is made, and the frozen
// worker's claim finds it.
//
// Two places to freeze, each in both modes:
//   - lost-connection: in the middle of the handler's function; the
//     server ends the frozen transaction meanwhile (here
//     pg_terminate_backend or KILL CONNECTION, as
//     idle_in_transaction_session_timeout would), and the worker, awake,
//     finds its connection gone and runs the transaction again on a new
//     one. Servers only: a SQLite transaction holds the file's write lock,
//     and the other worker waits for it.
//   - before-transaction: after the delivery arrived, before its
//     transaction began; nothing was lost, the worker just goes on late.
//     Not running the transaction again after a lost connection would not
//     close this one.
//
// The broker is Watermill's GoChannel; the redelivery's count is marked as
// settle's subscribers mark the counts they read from their brokers.
func TestFrozenWorkerDoesNotRunADeadLetteredMessage(t *testing.T) {
	t.Parallel()
	for _, mode := range []lossMode{lossOneStatement, lossBatch} {
		for _, point := range []string{"lost-connection", "before-transaction"} {
			t.Run(string(mode)+"/"+point, func(t *testing.T) {
				t.Parallel()
				on := onEachDriver
				if point == "lost-connection" {
					on = onServers
				}
				on(t,
					func(t *testing.T, d db[*sql.Tx]) { frozenWorker(t, d, mode, point) },
					func(t *testing.T, d db[pgx.Tx]) { frozenWorker(t, d, mode, point) })
			})
		}
	}
}

// gochannelInFlight is a GoChannel that says it has two deliveries of a
// subscription in flight, so that a batch handler is accepted on it (its
// batches are of one delivery).
type gochannelInFlight struct{ *gochannel.GoChannel }

func (gochannelInFlight) InFlight() int { return 2 }

func frozenWorker[TTx any](t *testing.T, d db[TTx], mode lossMode, point string) {
	ctx := t.Context()
	store, claims := claimsTableNamed(t, d)
	name := testenv.Name(t, "fz")
	effects := "effects_" + name[len(name)-8:]
	d.exec(t, "CREATE TABLE "+effects+" (msg VARCHAR(64) NOT NULL)")
	t.Cleanup(func() { _, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+effects) })

	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	topicA, topicB := name+"_a", name+"_b"
	parkedA, parkedB := collectOn(t, ps, topicA+".dead_letter"), collectOn(t, ps, topicB+".dead_letter")

	var runs atomic.Int32
	frozen := make(chan error, 1) // the frozen worker's transaction is ended (or could not be)
	held := make(chan struct{})   // the frozen worker holds the delivery, no transaction begun
	release := make(chan struct{})
	fn := func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
		if runs.Add(1) == 1 && point == "lost-connection" {
			// Worker A, frozen mid-transaction; the server ends it.
			frozen <- killOwnBackend(d, tx)
			<-release
		}
		_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+effects+" (msg) VALUES ("+d.ph(1)+")", msg.UUID)
		return err
	}
	worker := func(topic string, hold bool) {
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		must(t, err)
		if hold {
			var once atomic.Bool
			router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					if once.CompareAndSwap(false, true) {
						close(held)
						<-release
					}
					return h(msg)
				}
			})
		}
		// StoreTimeout (the transactions' CallTimeout) outlasts the freeze:
		// the handler's function is not cut short by it.
		p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: store, DisableTracing: true,
			StoreTimeout: time.Minute, BusyDelay: 20 * time.Millisecond,
			Retry: middleware.RetryConfig{MaxAttempts: 3, InProcessRetries: 1, InitialInterval: time.Millisecond,
				MaxInterval: 2 * time.Millisecond, RedeliveryDelay: time.Millisecond}})
		must(t, err)
		cfg := pipeline.TxConfig[TTx]{DB: d.Driver}
		txConfigIn(mode, &cfg)
		var sub message.Subscriber = ps
		if mode == lossBatch {
			sub = gochannelInFlight{ps}
		}
		_, err = pipeline.HandleTx(p, "charge", topic, sub, cfg, fn)
		must(t, err)
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		t.Cleanup(func() {
			must(t, router.Close())
			must(t, <-done)
		})
	}
	worker(topicA, point == "before-transaction")
	worker(topicB, false)
	unfreeze := sync1(func() { close(release) })
	t.Cleanup(unfreeze) // a failed test does not leave worker A frozen

	// Worker A gets the message's first delivery, and freezes.
	must(t, ps.Publish(topicA, message.NewMessage("order-1", []byte("x"))))
	select {
	case err := <-frozen:
		must(t, err)
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("worker A never got the delivery")
	}
	// The broker redelivers it to worker B with a count that leaves no
	// attempt (3 attempts of 2 runs a delivery; 8 deliveries before).
	again := message.NewMessage("order-1", []byte("x"))
	again.Metadata.Set(settle.MetaDeliveryCount, "9")
	again.Metadata.Set(deliverymark.Meta, deliverymark.Sign(again.UUID, "9"))
	must(t, ps.Publish(topicB, again))
	waitUpTo(t, 30*time.Second, "worker B dead-letters the redelivery", func() bool { return len(parkedB()) == 1 })

	// Worker A wakes up and goes on with its delivery.
	unfreeze()
	effect := func() int {
		return d.count(t, "SELECT COUNT(*) FROM "+effects+" WHERE msg = "+d.ph(1), "order-1")
	}
	waitUpTo(t, 30*time.Second, "worker A settles its delivery", func() bool { return effect() > 0 || len(parkedA()) > 0 })
	time.Sleep(200 * time.Millisecond) // anything more arrives by then

	dead := len(parkedA()) + len(parkedB())
	if n := effect(); n != 0 {
		t.Fatalf("order-1's effect is done (%d rows) and order-1 was dead-lettered (%d copies): two fates for one message", n, dead)
	}
	want := int32(1) // the frozen run, which never got to its effect
	if point == "before-transaction" {
		want = 0
	}
	if n := runs.Load(); n != want {
		t.Errorf("the handler's function ran %d times; want %d", n, want)
	}
	for _, m := range append(parkedA(), parkedB()...) {
		if got := m.Metadata.Get(settle.MetaOriginalUUID); got != "order-1" {
			t.Errorf("a dead-letter copy of %q; want order-1's only", got)
		}
	}
	// The refusal is what the frozen worker found: it stays.
	q := "SELECT state FROM " + d.quote(claims) + " WHERE key = " + d.ph(1)
	if d.Dialect() == sqldb.MySQL {
		q = "SELECT state FROM " + d.quote(claims) + " WHERE `key` = ?"
	}
	var state int
	must(t, d.sql.QueryRowContext(ctx, q, []byte(dedupe.ScopedKey("charge", "order-1"))).Scan(&state))
	if state != 3 {
		t.Errorf("order-1's key is in state %d; want 3, refused", state)
	}
}

// killOwnBackend ends the server session of tx from another connection
// (PostgreSQL's pg_terminate_backend, MySQL's KILL CONNECTION) and returns
// once it is gone, as the server's idle-in-transaction limit would end it.
func killOwnBackend[TTx any](d db[TTx], tx TTx) error {
	ctx := context.Background()
	if d.Dialect() == sqldb.Postgres {
		var pid int32
		if err := d.Tx(tx).QueryRow(ctx, "SELECT pg_backend_pid()", nil, &pid); err != nil {
			return err
		}
		var gone bool
		if err := d.sql.QueryRowContext(ctx, "SELECT pg_terminate_backend($1, 10000)", pid).Scan(&gone); err != nil || !gone {
			return fmt.Errorf("terminate backend %d: %v, %v", pid, gone, err)
		}
		return nil
	}
	var id int64
	if err := d.Tx(tx).QueryRow(ctx, "SELECT CONNECTION_ID()", nil, &id); err != nil {
		return err
	}
	if _, err := d.sql.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
		return err
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int
		if err := d.sql.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?", id).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
	}
	return fmt.Errorf("connection %d still there 10s after KILL", id)
}

// collectOn gathers what is published to topic on ps, acking it.
func collectOn(t *testing.T, ps *gochannel.GoChannel, topic string) func() []*message.Message {
	t.Helper()
	h := &harness{pubsub: ps}
	return h.collect(t, topic)
}

// waitUpTo waits for cond, failing the test after limit.
func waitUpTo(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, limit)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// sync1 is f, run at most once however often it is called.
func sync1(f func()) func() {
	var once atomic.Bool
	return func() {
		if once.CompareAndSwap(false, true) {
			f()
		}
	}
}
