package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/internal/wirecount"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// idleWindow is how long TestIdleRelayOnTheWire counts; at the default
// PollInterval of 1 s an idle relay may send idleWindow/1s statements, and
// one more for a tick on the window's edge.
const idleWindow = 5 * time.Second

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// TestIdleRelayOnTheWire counts, on the wire (a proxy reading the protocol's
// messages), the statements an idle relay sends on its own connections in
// the default RelayConfig, which is also the guide's and the examples':
// at most one per PollInterval, the heartbeat, LISTEN and the pool's
// health checks included. SQLite has no wire: there it counts what the
// relay's pool asks the driver to run (see stmtCount).
func TestIdleRelayOnTheWire(t *testing.T) {
	// The default, and a heartbeat every 2 s, so that heartbeats fall in
	// the window: on PostgreSQL they ride on the polls, on MySQL and SQLite
	// they take a poll's place.
	cfgs := []outbox.RelayConfig{{}, {HeartbeatInterval: 2 * time.Second}}
	run := func(t *testing.T, open opener) {
		for _, cfg := range cfgs {
			t.Run(fmt.Sprintf("heartbeat=%v", cfg.HeartbeatInterval), func(t *testing.T) { idleRun(t, open, cfg) })
		}
	}
	t.Run("postgres-pgx", func(t *testing.T) {
		rawURL := testenv.Require(t, testenv.PostgresURLEnv)
		run(t, func(t *testing.T) (counter, relayOutbox, func() error) {
			w, u := newWire(t, rawURL)
			pool, err := pgxpool.New(context.Background(), u)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			ob, initSchema := idleOutbox(t, sqldb.Pgx(pool), testenv.Postgres(t))
			return w, ob, initSchema
		})
	})
	t.Run("postgres-std", func(t *testing.T) {
		rawURL := testenv.Require(t, testenv.PostgresURLEnv)
		run(t, func(t *testing.T) (counter, relayOutbox, func() error) {
			w, u := newWire(t, rawURL)
			ob, initSchema := idleOutbox(t, sqldb.Std(openURL(t, u), sqldb.Postgres), testenv.Postgres(t))
			return w, ob, initSchema
		})
	})
	t.Run("mysql", func(t *testing.T) {
		rawURL := testenv.Require(t, testenv.MySQLURLEnv)
		run(t, func(t *testing.T) (counter, relayOutbox, func() error) {
			w, u := newWire(t, rawURL)
			ob, initSchema := idleOutbox(t, sqldb.Std(openURL(t, u), sqldb.MySQL), testenv.MySQL(t))
			return w, ob, initSchema
		})
	})
	t.Run("sqlite", func(t *testing.T) {
		run(t, func(t *testing.T) (counter, relayOutbox, func() error) {
			db, c := openCounted(t)
			ob, initSchema := idleOutbox(t, db.Driver(), db)
			return c, ob, initSchema
		})
	})
}

// counter counts the statements a relay sends.
type counter interface {
	Statements() int64
	Messages() string // by kind, for failure reports
}

// opener returns a statement counter, an outbox whose statements it
// counts, and the function that creates its table.
type opener func(t *testing.T) (counter, relayOutbox, func() error)

// idleRun runs a relay with cfg on an outbox of open and fails if it sends
// more than one statement per second while idle.
func idleRun(t *testing.T, open opener, cfg outbox.RelayConfig) {
	w, ob, initSchema := open(t)
	if err := initSchema(); err != nil {
		t.Fatal(err)
	}
	r, err := ob.NewRelay(discard{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runUntilEnd(t, r, func(error) {})
	// Past the start (register, LISTEN, the first scan, the pool's first
	// connections), then count.
	time.Sleep(1500 * time.Millisecond)
	before, kinds := w.Statements(), w.Messages()
	time.Sleep(idleWindow)
	n := w.Statements() - before
	t.Logf("%d statements in %v idle (%.2f/s); messages before: %s; after: %s", n, idleWindow, float64(n)/idleWindow.Seconds(), kinds, w.Messages())
	if limit := int64(idleWindow/time.Second) + 1; n > limit {
		t.Errorf("an idle relay sent %d statements in %v on the wire, want <= %d (one per PollInterval); messages before: %s; after: %s", n, idleWindow, limit, kinds, w.Messages())
	}
}

// newWire starts a wirecount proxy to the server of rawURL, stopped when
// the test ends, and returns it with the URL that reaches the server
// through it.
func newWire(t *testing.T, rawURL string) (*wirecount.Proxy, string) {
	t.Helper()
	w, u, err := wirecount.Start(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return w, u
}

type relayOutbox interface {
	NewRelay(message.Publisher, outbox.RelayConfig) (*outbox.Relay, error)
}

func openURL(t *testing.T, u string) *sql.DB {
	t.Helper()
	db, _, err := sqlurl.Open(u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// idleOutbox returns an outbox of a table of the test on d, and the
// function that creates the table (dropped, through db, when the test ends).
func idleOutbox[TTx any](t *testing.T, d sqldb.Driver[TTx], db testenv.DB) (relayOutbox, func() error) {
	name := testenv.Name(t, "idle")
	topic := "idle" + name[len(name)-9:] // Config.Topic's bound is below Name's
	ob, err := outbox.New(d, outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		q := func(s string) string {
			if db.Dialect == sqldb.MySQL {
				return "`" + s + "`"
			}
			return `"` + s + `"`
		}
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q(topic))
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q(topic+"_relays"))
	})
	return ob, func() error { return ob.InitSchema(t.Context()) }
}

// A heartbeat due at every tick (HeartbeatInterval < PollInterval) still
// leaves the relay polling: a row no wake-up announced (written by another
// process) is forwarded. On MySQL and SQLite a heartbeat takes the place of
// a poll only after a poll that found nothing.
func TestRelayPollsWhileHeartbeatsAreDueAtEveryTick(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		got, err := e.pubsub.Subscribe(t.Context(), "orders")
		if err != nil {
			t.Fatal(err)
		}
		// A heartbeat due at every tick.
		startRelay(t, e, e.pubsub, outbox.RelayConfig{PollInterval: 100 * time.Millisecond, HeartbeatInterval: time.Microsecond})
		time.Sleep(500 * time.Millisecond) // idle: polls, heartbeats
		e.rawInsert(t, "unannounced", "orders", []byte(`{}`), `{}`)
		select {
		case m := <-got:
			m.Ack()
			if m.UUID != "unannounced" {
				t.Fatalf("got %s", m.UUID)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a row committed without a wake-up was not forwarded in 10 s (100 ms polls)")
		}
	})
}
