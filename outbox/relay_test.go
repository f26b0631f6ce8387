package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// failOnce fails the first publish to topic, then passes every publish on.
type failOnce struct {
	message.Publisher
	topic  string
	failed atomic.Bool
}

var errBrokerDown = errors.New("broker down")

func (p *failOnce) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.failed.CompareAndSwap(false, true) {
		return errBrokerDown
	}
	return p.Publisher.Publish(topic, msgs...)
}

// A settle row whose publish fails is retried, never set aside as foreign.
func TestFailedPublishIsRetriedNotPoisoned(t *testing.T) {
	t.Parallel()
	forEach(t, postgresDrivers(), testFailedPublishIsRetriedNotPoisoned)
}

func testFailedPublishIsRetriedNotPoisoned(t *testing.T, e *env) {
	poisoned, err := e.pubsub.Subscribe(t.Context(), e.ob.Topic()+"_poison")
	if err != nil {
		t.Fatal(err)
	}
	placed, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	e.placeOrder(t, t.Context(), "A-9", true, message.NewMessage("retried", []byte(`{"id":"A-9"}`)))

	out := &failOnce{Publisher: e.pubsub, topic: "orders.placed"}
	r, err := e.ob.NewRelay(out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(t.Context()) }()
	<-r.Running()
	if err := r.Drain(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	if !out.failed.Load() {
		t.Fatal("the publish never failed: the test did not test anything")
	}
	if m := <-placed; m.UUID != "retried" {
		t.Fatalf("placed got %s", m.UUID)
	}
	if fwd, failed := r.Counts(); fwd != 1 || failed != 1 {
		t.Fatalf("Counts = %d forwarded, %d failed; want 1 and 1", fwd, failed)
	}
	select {
	case m := <-poisoned:
		t.Fatalf("a settle row reached the poison topic: %s", m.Payload)
	default:
	}
}

// slowBroker holds each publish until released, and says when one started.
type slowBroker struct {
	message.Publisher
	started chan struct{}
	release chan struct{}
}

func (b *slowBroker) Publish(topic string, msgs ...*message.Message) error {
	select {
	case b.started <- struct{}{}:
	default:
	}
	<-b.release
	return b.Publisher.Publish(topic, msgs...)
}

// A relay closed while it publishes still marks what it published: the
// rows are not pending afterwards, so the next relay does not send them
// again. On every database.
func TestCloseMidBatchMarksWhatWasPublished(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		e.placeOrder(t, t.Context(), "C-1", true, message.NewMessage("published", []byte(`{}`)))
		out := &slowBroker{Publisher: e.pubsub, started: make(chan struct{}, 1), release: make(chan struct{})}
		r, err := e.ob.NewRelay(out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(t.Context()) }()
		<-out.started
		closed := make(chan error, 1)
		go func() { closed <- r.Close() }()
		time.Sleep(100 * time.Millisecond) // Close has cancelled the relay's context
		close(out.release)
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		st, err := e.ob.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending != 0 {
			t.Fatalf("%d rows pending after a relay closed mid-batch had published them", st.Pending)
		}
		if fwd, _ := r.Counts(); fwd != 1 {
			t.Fatalf("Counts: %d forwarded, want 1", fwd)
		}
	})
}

// Writers commit (90%) or roll back (10%) transactions of 1-3 messages
// after random delays, while two relays on a pool of their own that poll
// once an hour forward on NOTIFY: every committed message arrives exactly
// once, no rolled-back one. On both PostgreSQL drivers.
func TestConcurrentWritersTwoRelaysOnNotify(t *testing.T) {
	t.Parallel()
	forEach(t, postgresDrivers(), func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
		if err != nil {
			t.Fatal(err)
		}
		relays := e.elsewhere(t, outbox.Config{Topic: e.ob.Topic()})
		for range 2 {
			r, err := relays.NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: time.Hour, BatchSize: 7})
			if err != nil {
				t.Fatal(err)
			}
			runUntilEnd(t, r, func(error) {})
		}
		const writers, txs = 4, 25
		var (
			mu        sync.Mutex
			committed = map[string]bool{}
		)
		var wg sync.WaitGroup
		for w := range writers {
			wg.Go(func() {
				for i := range txs {
					commit := rand.IntN(10) != 0
					var msgs []*message.Message
					for k := range 1 + rand.IntN(3) {
						msgs = append(msgs, message.NewMessage(fmt.Sprintf("w%d-t%d-m%d", w, i, k), []byte(`{}`)))
					}
					if err := e.writeTx(t.Context(), fmt.Sprintf("w%d-t%d", w, i), commit, time.Duration(rand.IntN(20))*time.Millisecond, msgs); err != nil {
						t.Error(err)
						return
					}
					if commit {
						mu.Lock()
						for _, m := range msgs {
							committed[m.UUID] = true
						}
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
		seen := map[string]bool{}
		for len(seen) < len(committed) {
			select {
			case m := <-got:
				m.Ack()
				if !committed[m.UUID] {
					t.Fatalf("%s forwarded, but its transaction rolled back", m.UUID)
				}
				if seen[m.UUID] {
					t.Fatalf("%s forwarded twice", m.UUID)
				}
				seen[m.UUID] = true
			case <-time.After(10 * time.Second):
				t.Fatalf("%d of %d committed messages forwarded", len(seen), len(committed))
			}
		}
		select {
		case m := <-got:
			t.Fatalf("%s forwarded after all committed ones (again?)", m.UUID)
		case <-time.After(200 * time.Millisecond):
		}
	})
}

// writeTx is placeOrder for writers that report instead of failing, with a
// delay before the end of the transaction.
func (e *env) writeTx(ctx context.Context, id string, commit bool, delay time.Duration, msgs []*message.Message) error {
	tx, err := e.ob.begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := tx.Exec(ctx, "INSERT INTO "+e.table+" (id) VALUES ("+e.ph(1)+")", id); err != nil {
		return err
	}
	if err := tx.Pub.Publish("orders.placed", msgs...); err != nil {
		return err
	}
	time.Sleep(delay)
	if !commit {
		return tx.Rollback()
	}
	return tx.Commit()
}

// On a pool of one connection the relay does not LISTEN (that would hold
// the only connection for good and starve its batches): it polls, and
// forwards. On both PostgreSQL drivers.
func TestRelayOnOneConnectionPolls(t *testing.T) {
	t.Parallel()
	forEach(t, postgresDrivers(), func(t *testing.T, e *env) {
		var one *obx
		cfg := outbox.Config{Topic: e.ob.Topic()}
		if e.d.pgx {
			pc, err := pgxpool.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
			if err != nil {
				t.Fatal(err)
			}
			pc.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(t.Context(), pc)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			d := sqldb.Pgx(pool)
			ob, err := outbox.New(d, cfg)
			if err != nil {
				t.Fatal(err)
			}
			one = wrap(d, ob)
		} else {
			db := testenv.Postgres(t)
			db.SetMaxOpenConns(1)
			d := sqldb.Std(db.DB, sqldb.Postgres)
			ob, err := outbox.New(d, cfg)
			if err != nil {
				t.Fatal(err)
			}
			one = wrap(d, ob)
		}
		got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
		if err != nil {
			t.Fatal(err)
		}
		r, err := one.NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, AckDeadline: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
			_ = r.Close()
		})
		select {
		case <-r.Running():
		case <-time.After(5 * time.Second):
			t.Fatal("a relay on a one-connection pool did not start (its LISTEN holds the only connection?)")
		}
		e.placeOrder(t, t.Context(), "C-1", true, message.NewMessage("one-conn", []byte(`{}`)))
		select {
		case m := <-got:
			m.Ack()
			if m.UUID != "one-conn" {
				t.Fatalf("got %s", m.UUID)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a relay on a one-connection pool forwarded nothing")
		}
	})
}
