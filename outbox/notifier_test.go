package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// afterCommit returns two Outboxes of e's topic with NotifyAfterCommit: one
// for the writers and one for a relay, as two processes would have them,
// so that the writers' Notify cannot wake the relay in-process. The relay
// runs on a pool of its own, polls once an hour, and forwards to e.pubsub.
func afterCommit(t *testing.T, e *env) (writer *obx, got <-chan *message.Message) {
	t.Helper()
	cfg := outbox.Config{Topic: e.ob.Topic(), NotifyAfterCommit: true}
	writer = e.another(t, cfg)
	other := e.elsewhere(t, cfg)
	got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	r, err := other.NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	runUntilEnd(t, r, func(error) {})
	// The relay scans once when its LISTEN is in place; let that pass.
	time.Sleep(500 * time.Millisecond)
	e.ob = writer
	return writer, got
}

// listenCount counts the notifications on the outbox's channel until the
// test ends.
func listenCount(t *testing.T, e *env) func() int {
	t.Helper()
	c, err := pgx.Connect(t.Context(), testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(t.Context(), `LISTEN "`+e.ob.Table()+`"`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	n := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := c.WaitForNotification(ctx); err != nil {
				return
			}
			mu.Lock()
			n++
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = c.Close(context.Background())
	})
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// With NotifyAfterCommit, a relay in another process learns of commits
// from the writers' Notifier, not from the INSERT: nothing arrives while
// there is no Notifier, and every message of concurrent writers arrives,
// once, when there is one.
func TestNotifierWakesRelaysOfOtherProcesses(t *testing.T) {
	t.Parallel()
	forEach(t, postgresDrivers(), testNotifierWakesRelaysOfOtherProcesses)
}

func testNotifierWakesRelaysOfOtherProcesses(t *testing.T, e *env) {
	count := listenCount(t, e)
	writer, got := afterCommit(t, e)

	// No Notifier: the INSERT does not notify and Notify has no one to
	// ask, so the relay (polling hourly) stays asleep.
	e.placeOrder(t, t.Context(), "N-0", true, message.NewMessage("before", []byte(`{}`)))
	writer.Notify()
	select {
	case m := <-got:
		t.Fatalf("%s forwarded without a NOTIFY", m.UUID)
	case <-time.After(700 * time.Millisecond):
	}
	if n := count(); n != 0 {
		t.Fatalf("%d notifications without a Notifier", n)
	}

	runNotifier(t, writer)
	const writers, each = 4, 25
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				id := fmt.Sprintf("N-%d-%d", w, i)
				e.placeOrder(t, t.Context(), id, true, message.NewMessage(id, []byte(`{}`)))
				writer.Notify()
			}
		})
	}
	wg.Wait()
	seen := map[string]int{}
	deadline := time.After(10 * time.Second)
	for len(seen) < writers*each+1 {
		select {
		case m := <-got:
			m.Ack()
			seen[m.UUID]++
		case <-deadline:
			t.Fatalf("%d of %d messages forwarded", len(seen), writers*each+1)
		}
	}
	for id, k := range seen {
		if k != 1 {
			t.Errorf("%s forwarded %d times", id, k)
		}
	}
	if c := count(); c < 1 || c > writers*each {
		t.Errorf("%d notifications for %d commits", c, writers*each)
	}
}

// Notify calls that come faster than NOTIFYs can be sent share them.
func TestNotifierCoalesces(t *testing.T) {
	t.Parallel()
	forEach(t, postgresDrivers(), testNotifierCoalesces)
}

func testNotifierCoalesces(t *testing.T, e *env) {
	count := listenCount(t, e)
	writer := e.another(t, outbox.Config{Topic: e.ob.Topic(), NotifyAfterCommit: true})
	n := runNotifier(t, writer)
	const calls = 2000
	for range calls {
		writer.Notify()
	}
	// A request made before Close still gets its NOTIFY.
	_ = n.Close()
	deadline := time.Now().Add(5 * time.Second)
	for count() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	if c := count(); c < 1 || c > calls/10 {
		t.Fatalf("%d notifications for %d Notify calls, want 1..%d", c, calls, calls/10)
	}
	// Closed: no more NOTIFYs, and Notify does not block.
	before := count()
	writer.Notify()
	time.Sleep(200 * time.Millisecond)
	if c := count(); c != before {
		t.Fatalf("a closed Notifier sent %d notifications", c-before)
	}
}

// runNotifier runs a Notifier of ob until the test ends.
func runNotifier(t *testing.T, ob *obx) *outbox.Notifier {
	t.Helper()
	n, err := ob.NewNotifier()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- n.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = n.Close()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return n
}

// A Notifier starts no goroutine until Run, and none outlives Run: Run
// returns at Close or when its context ends. A request made before Run
// waits for it. Not parallel: goleak sees every goroutine of the process.
func TestNotifierGoroutinesEndWithRun(t *testing.T) {
	for _, d := range postgresDrivers() {
		t.Run(d.name, func(t *testing.T) {
			e := setup(t, d)
			count := listenCount(t, e)
			writer := e.another(t, outbox.Config{Topic: e.ob.Topic(), NotifyAfterCommit: true})
			if _, err := writer.Status(t.Context()); err != nil { // the pool's first connection
				t.Fatal(err)
			}
			before := goleak.IgnoreCurrent()
			for _, stop := range []string{"Close", "ctx"} {
				n, err := writer.NewNotifier()
				if err != nil {
					t.Fatal(err)
				}
				if err := goleak.Find(before); err != nil {
					t.Fatalf("NewNotifier started a goroutine: %v", err)
				}
				sent := count()
				writer.Notify() // before Run: waits for it
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- n.Run(ctx) }()
				for deadline := time.Now().Add(5 * time.Second); count() == sent; time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("%s: the request made before Run got no NOTIFY", stop)
					}
				}
				if stop == "Close" {
					_ = n.Close()
				} else {
					cancel()
				}
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				cancel()
				_ = n.Close()
				if err := n.Run(context.Background()); err == nil {
					t.Fatalf("%s: a second Run succeeded", stop)
				}
				if err := goleak.Find(before); err != nil {
					t.Fatalf("a goroutine outlived the Notifier's Run (ended by %s): %v", stop, err)
				}
			}
			// Closed before it ran: Run returns at once.
			n, err := writer.NewNotifier()
			if err != nil {
				t.Fatal(err)
			}
			_ = n.Close()
			ran := make(chan error, 1)
			go func() { ran <- n.Run(t.Context()) }()
			select {
			case err := <-ran:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Run after Close did not return")
			}
		})
	}
}

func TestNewNotifierRefuses(t *testing.T) {
	t.Parallel()
	sqlite := sqldb.Std(testenv.SQLite(t).DB, sqldb.SQLite)
	mysql := sqldb.Std(&sql.DB{}, sqldb.MySQL)
	postgres := sqldb.Std(&sql.DB{}, sqldb.Postgres)
	for _, c := range []struct {
		db   sqldb.Driver[*sql.Tx]
		cfg  outbox.Config
		want string
	}{
		{sqlite, outbox.Config{NotifyAfterCommit: true}, "NOTIFY is PostgreSQL's"},
		{mysql, outbox.Config{NotifyAfterCommit: true}, "NOTIFY is PostgreSQL's"},
		{postgres, outbox.Config{}, "NotifyAfterCommit is false"},
	} {
		ob, err := outbox.New(c.db, c.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ob.NewNotifier(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an error containing %q", c.db.Dialect(), err, c.want)
		}
	}
}
