package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// Bounds of TestRelaySurvivesLosingItsListenConnection, generous for a
// loaded machine: with the defaults the relay LISTENs again RetryInterval
// (1 s) after the loss and forwards what was committed meanwhile; its loop
// polls on the pool after 2 PollIntervals without the LISTEN connection's
// polls.
const (
	listenKills  = 5
	resumeBound  = 10 * time.Second // a row committed after a kill is delivered
	relistenWait = 15 * time.Second // a new connection LISTENs
)

// counted is the destination: it counts each message it is handed, by
// UUID.
type counted struct {
	mu  sync.Mutex
	got map[string]int
	at  map[string]time.Time // first delivery
}

func (c *counted) Publish(_ string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.got[m.UUID]++
		if _, ok := c.at[m.UUID]; !ok {
			c.at[m.UUID] = time.Now()
		}
	}
	return nil
}
func (c *counted) Close() error { return nil }

func (c *counted) has(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.got[id] > 0
}

// TestRelaySurvivesLosingItsListenConnection terminates, with
// pg_terminate_backend, the backend of the relay's LISTEN connection
// several times at random moments while a writer keeps committing rows, and
// checks on the destination that every row is delivered exactly once, that
// a row committed after each kill is delivered within resumeBound, that a
// new connection LISTENs after each kill, and that the relay, idle again,
// sends at most one statement per second on the wire.
func TestRelaySurvivesLosingItsListenConnection(t *testing.T) {
	t.Parallel()
	pgURL := testenv.Require(t, testenv.PostgresURLEnv)
	pgxOpen := func(t *testing.T, u string) (relayOutbox, func() error) {
		pool, err := pgxpool.New(context.Background(), u)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return idleOutbox(t, sqldb.Pgx(pool), testenv.Postgres(t))
	}
	stdOpen := func(t *testing.T, u string) (relayOutbox, func() error) {
		return idleOutbox(t, sqldb.Std(openURL(t, u), sqldb.Postgres), testenv.Postgres(t))
	}
	for _, tc := range []struct {
		name string
		open func(t *testing.T, u string) (relayOutbox, func() error)
		cfg  outbox.RelayConfig
		// minDelay is the least time between a new LISTEN and its kill.
		minDelay time.Duration
	}{
		{name: "pgx", open: pgxOpen, minDelay: 200 * time.Millisecond},
		{name: "std", open: stdOpen, minDelay: 200 * time.Millisecond},
		// A connection that LISTENed for a PollInterval is replaced at
		// once, not after RetryInterval: the commits made meanwhile do not
		// wait a minute for the relay's poll on the pool either.
		{name: "pgx/RetryInterval=1m", open: pgxOpen, cfg: outbox.RelayConfig{RetryInterval: time.Minute}, minDelay: 1200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			listenKillRun(t, pgURL, tc.open, tc.cfg, tc.minDelay)
		})
	}
}

func listenKillRun(t *testing.T, pgURL string, open func(t *testing.T, u string) (relayOutbox, func() error), cfg outbox.RelayConfig, minDelay time.Duration) {
	w, u := newWire(t, pgURL)
	ob, initSchema := open(t, u)
	if err := initSchema(); err != nil {
		t.Fatal(err)
	}
	// The writer commits on its own connections, not through the proxy, on
	// the same table.
	db := testenv.Postgres(t)
	topic := ob.(interface{ Topic() string }).Topic()
	writer, err := outbox.New(sqldb.Std(db.DB, sqldb.Postgres), outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	dest := &counted{got: map[string]int{}, at: map[string]time.Time{}}
	r, err := ob.NewRelay(dest, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runUntilEnd(t, r, func(error) {})

	// The writer: one row per transaction, every 5-30 ms, until stopped.
	var (
		mu      sync.Mutex
		started = map[string]time.Time{} // when its transaction began
		sent    []string
	)
	stop := make(chan struct{})
	var writing sync.WaitGroup
	writing.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(5+rand.IntN(25)) * time.Millisecond):
			}
			id := fmt.Sprintf("m-%05d", i)
			begin := time.Now()
			tx, err := db.BeginTx(context.Background(), nil)
			if err != nil {
				t.Error(err)
				return
			}
			pub, err := writer.TxPublisher(tx)
			if err == nil {
				err = pub.Publish(topic, message.NewMessage(id, []byte(`{}`)))
			}
			if err != nil {
				_ = tx.Rollback()
				t.Error(err)
				return
			}
			if err := tx.Commit(); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			started[id] = begin
			sent = append(sent, id)
			mu.Unlock()
		}
	})
	stopWriting := sync.OnceFunc(func() { close(stop); writing.Wait() })
	t.Cleanup(stopWriting)

	// waitFor polls cond until it holds or bound passes.
	waitFor := func(bound time.Duration, cond func() bool) bool {
		deadline := time.Now().Add(bound)
		for !cond() {
			if time.Now().After(deadline) {
				return false
			}
			time.Sleep(5 * time.Millisecond)
		}
		return true
	}
	listener := func(killed []int) int {
		var port int
		ok := waitFor(relistenWait, func() bool {
			for _, p := range w.Listening() {
				if !slices.Contains(killed, p) {
					port = p
					return true
				}
			}
			return false
		})
		if !ok {
			t.Fatalf("no new connection LISTENs %v after the last kill (ports killed: %v, listening: %v)", relistenWait, killed, w.Listening())
		}
		return port
	}

	var killed []int
	for k := range listenKills {
		port := listener(killed)
		time.Sleep(minDelay + time.Duration(rand.IntN(1500))*time.Millisecond)
		var pid int
		var last string
		if err := db.QueryRowContext(t.Context(), "SELECT pid, query FROM pg_stat_activity WHERE client_port = $1", port).Scan(&pid, &last); err != nil {
			t.Fatalf("kill %d: the backend at port %d: %v", k, port, err)
		}
		var ok bool
		if err := db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("kill %d: pg_terminate_backend(%d) = %v, %v", k, pid, ok, err)
		}
		killedAt := time.Now()
		killed = append(killed, port)
		// Delivery resumes: a row whose transaction began after the kill
		// reaches the destination.
		var first string
		resumed := waitFor(resumeBound, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, id := range slices.Backward(sent) {
				if started[id].Before(killedAt) {
					return false
				}
				if dest.has(id) {
					first = id
					return true
				}
			}
			return false
		})
		if !resumed {
			t.Fatalf("kill %d (backend %d): no row committed after it was delivered within %v", k, pid, resumeBound)
		}
		dest.mu.Lock()
		took := dest.at[first].Sub(killedAt)
		dest.mu.Unlock()
		t.Logf("kill %d: backend %d (last statement %.40q) terminated; a row committed after it (%s) delivered %v after the kill", k, pid, last, first, took.Round(time.Millisecond))
	}
	listener(killed) // LISTENing again after the last kill
	stopWriting()

	// Every row, exactly once, on the destination.
	mu.Lock()
	want := slices.Clone(sent)
	mu.Unlock()
	if len(want) == 0 {
		t.Fatal("the writer committed nothing")
	}
	if !waitFor(resumeBound, func() bool {
		for _, id := range want {
			if !dest.has(id) {
				return false
			}
		}
		return true
	}) {
		t.Errorf("rows not delivered %v after the writer stopped", resumeBound)
	}
	dest.mu.Lock()
	var missing, twice, unknown []string
	for _, id := range want {
		switch n := dest.got[id]; {
		case n == 0:
			missing = append(missing, id)
		case n > 1:
			twice = append(twice, fmt.Sprintf("%s×%d", id, n))
		}
	}
	for id := range dest.got {
		if !slices.Contains(want, id) {
			unknown = append(unknown, id)
		}
	}
	dest.mu.Unlock()
	if len(missing)+len(twice)+len(unknown) > 0 {
		t.Fatalf("of %d rows: missing %v; delivered more than once %v; never committed %v", len(want), missing, twice, unknown)
	}
	t.Logf("%d rows committed, each delivered once, across %d kills", len(want), listenKills)

	// Idle again: at most one statement per PollInterval on the wire.
	time.Sleep(1500 * time.Millisecond)
	before, kinds := w.Statements(), w.Messages()
	time.Sleep(idleWindow)
	n := w.Statements() - before
	t.Logf("after the kills: %d statements in %v idle (%.2f/s)", n, idleWindow, float64(n)/idleWindow.Seconds())
	if limit := int64(idleWindow/time.Second) + 1; n > limit {
		t.Errorf("after the kills an idle relay sent %d statements in %v on the wire, want <= %d; messages before: %s; after: %s", n, idleWindow, limit, kinds, w.Messages())
	}
}
