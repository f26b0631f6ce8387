package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// errLog records the errors a relay logs.
type errLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []string
}

func (l *errLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, msg+": "+err.Error())
}

func (l *errLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errs...)
}

// A relay closed before it ran has stopped: a Run after Close returns at
// once, with no statement on the database (which its owner may close right
// after Close: here it is closed), and leaves no goroutine behind.
//
// Not parallel, nor its subtests: goleak sees every test's goroutines.
func TestReview25RelayRunAfterCloseTouchesNothing(t *testing.T) {
	inTurn(t, []drv{sqliteDrv, postgresDrv, pgxDrv}, func(t *testing.T, e *env) {
		log := &errLog{}
		var ob *obx
		var closeDB func()
		cfg := outbox.Config{Topic: e.ob.Topic()}
		if e.d.pgx {
			pool, err := pgxpool.New(context.Background(), testenv.Require(t, testenv.PostgresURLEnv))
			if err != nil {
				t.Fatal(err)
			}
			d := sqldb.Pgx(pool)
			o, err := outbox.New(d, cfg)
			if err != nil {
				t.Fatal(err)
			}
			ob, closeDB = wrap(d, o), pool.Close
		} else {
			own, d, err := sqlurl.Open(dbURL(t, e))
			if err != nil {
				t.Fatal(err)
			}
			o, err := outbox.New(sqldb.Std(own, d), cfg)
			if err != nil {
				t.Fatal(err)
			}
			ob, closeDB = wrap(sqldb.Std(own, d), o), func() { _ = own.Close() }
		}
		r, err := ob.NewRelay(e.pubsub, outbox.RelayConfig{Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		before := goleak.IgnoreCurrent()
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		closeDB()
		ran := make(chan error, 1)
		go func() { ran <- r.Run(t.Context()) }()
		select {
		case err := <-ran:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Run after Close did not return")
		}
		if err := goleak.Find(before); err != nil {
			t.Fatalf("a goroutine outlived Run after Close: %v", err)
		}
		if errs := log.all(); len(errs) > 0 {
			t.Errorf("Run after Close ran statements (on a database closed after Close): %q", errs)
		}
	})
}

// dbURL is the URL of e's database.
func dbURL(t *testing.T, e *env) string {
	if e.db.Dialect == sqldb.SQLite {
		var path string
		if err := e.db.QueryRowContext(t.Context(), "SELECT file FROM pragma_database_list WHERE name = 'main'").Scan(&path); err != nil {
			t.Fatal(err)
		}
		return "sqlite://" + path
	}
	return testenv.Require(t, testenv.PostgresURLEnv)
}

// A relay whose context ends while it LISTENs returns, closes the LISTEN
// connection (never hands it back to the pool, where the next user would
// get a connection still listening) and leaves no goroutine behind.
//
// Not parallel, nor its subtests: goleak sees every test's goroutines.
func TestReview25RelayCancelledMidListen(t *testing.T) {
	inTurn(t, postgresDrivers(), func(t *testing.T, e *env) {
		r, err := e.ob.NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		before := goleak.IgnoreCurrent()
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- r.Run(ctx) }()
		<-r.Running()
		listening := func() int {
			var n int
			if err := e.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM pg_stat_activity WHERE query = $1", `LISTEN "`+e.ob.Table()+`"`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		for deadline := time.Now().Add(5 * time.Second); listening() == 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the relay never LISTENed")
			}
		}
		cancel()
		select {
		case err := <-ran:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Run did not return when its context ended mid-LISTEN")
		}
		for deadline := time.Now().Add(5 * time.Second); listening() != 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the LISTEN connection is still open after Run returned")
			}
		}
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		if err := goleak.Find(before); err != nil {
			t.Fatalf("a goroutine outlived the relay: %v", err)
		}
		if err := r.Run(context.Background()); err == nil {
			t.Fatal("a second Run succeeded")
		}
	})
}

// inTurn is forEach with the drivers one after the other.
func inTurn(t *testing.T, ds []drv, fn func(t *testing.T, e *env)) {
	for _, d := range ds {
		t.Run(d.name, func(t *testing.T) { fn(t, setup(t, d)) })
	}
}
