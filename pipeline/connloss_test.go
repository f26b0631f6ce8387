package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// lossTx is what the test's handler does in its transaction, whatever the
// driver: write its effect, and terminate the transaction's own backend.
type lossTx struct {
	insert   func(id string) error
	kill     func() error // returns once the backend is gone
	badQuery func() error // a statement on a table that does not exist
}

type lossBody func(ctx context.Context, msg *message.Message, tx lossTx, out message.Publisher) error

// lossDB is one database and driver under the test: a claims store, an
// outbox, a table of effects with no key (an effect done twice is two rows),
// and the handler added to a pipeline in a given mode.
type lossDB struct {
	store   dedupe.Store
	add     func(p *pipeline.Pipeline, topic string, sub message.Subscriber, mode lossMode, body lossBody) error
	effects func(t *testing.T) (total, distinct int)
	outbox  func(t *testing.T) int
	claim   func(t *testing.T, key string) (state, attempts int) // -1, -1 when the key has no row
}

type lossMode string

const (
	lossDefault      lossMode = "default"
	lossOneStatement lossMode = "one_statement"
	lossBatch        lossMode = "batch"
)

func txConfigIn[TTx any](m lossMode, cfg *pipeline.TxConfig[TTx]) {
	switch m {
	case lossOneStatement:
		cfg.OneStatement = true
	case lossBatch:
		cfg.Batch = pipeline.BatchConfig{MaxSize: 4, MaxWait: 5 * time.Millisecond}
	}
}

// lossDBOn is the lossDB of d; admin is another connection to the same
// server, which kills the handler's backends (found by a statement in the
// handler's transaction, whatever the driver).
func lossDBOn[TTx any](t *testing.T, d db[TTx], admin testenv.DB) lossDB {
	t.Helper()
	e := newTxEnv(t, d)
	effects := effectTable(t, e, &d.sql, &admin, "id VARCHAR(64) NOT NULL")
	kill := func(tx TTx) error {
		ctx := context.Background()
		if d.Dialect() == sqldb.Postgres {
			var pid int32
			if err := d.Tx(tx).QueryRow(ctx, "SELECT pg_backend_pid()", nil, &pid); err != nil {
				return err
			}
			var gone bool
			if err := admin.QueryRowContext(ctx, "SELECT pg_terminate_backend($1, 10000)", pid).Scan(&gone); err != nil || !gone {
				return fmt.Errorf("terminate backend %d: %v, %v", pid, gone, err)
			}
			return nil
		}
		var id int64
		if err := d.Tx(tx).QueryRow(ctx, "SELECT CONNECTION_ID()", nil, &id); err != nil {
			return err
		}
		if _, err := admin.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
			return err
		}
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			var n int
			if err := admin.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?", id).Scan(&n); err != nil {
				return err
			}
			if n == 0 {
				return nil
			}
		}
		return fmt.Errorf("connection %d still there 10s after KILL", id)
	}
	return lossDB{
		store: e.store,
		add: func(p *pipeline.Pipeline, topic string, sub message.Subscriber, mode lossMode, body lossBody) error {
			cfg := pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob}
			txConfigIn(mode, &cfg)
			_, err := pipeline.HandleTx(p, "charge", topic, sub, cfg, func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
				return body(ctx, msg, lossTx{
					insert: func(id string) error {
						_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+effects+" (id) VALUES ("+d.ph(1)+")", id)
						return err
					},
					kill: func() error { return kill(tx) },
					badQuery: func() error {
						_, err := d.Tx(tx).Exec(ctx, "SELECT id FROM "+effects+"_missing")
						return err
					},
				}, out)
			})
			return err
		},
		effects: func(t *testing.T) (total, distinct int) {
			must(t, admin.QueryRowContext(t.Context(), "SELECT COUNT(*), COUNT(DISTINCT id) FROM "+effects).Scan(&total, &distinct))
			return
		},
		outbox: func(t *testing.T) (n int) {
			must(t, admin.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+d.quote(e.ob.Table())).Scan(&n))
			return
		},
		claim: func(t *testing.T, key string) (state, attempts int) {
			q := `SELECT state, attempts FROM "` + e.claims + `" WHERE key = $1`
			if d.Dialect() == sqldb.MySQL {
				q = "SELECT state, attempts FROM `" + e.claims + "` WHERE `key` = ?"
			}
			err := admin.QueryRowContext(t.Context(), q, []byte(key)).Scan(&state, &attempts)
			if err == sql.ErrNoRows {
				return -1, -1
			}
			must(t, err)
			return
		},
	}
}

// TestTransactionLosingItsConnectionSpendsNoAttempt terminates the
// backend of a handler's own transaction (pg_terminate_backend, KILL
// CONNECTION) on several runs of one message, in the middle of its handler
// or after its handler's work (where settle's next statement, the
// confirmation, the batch's outbox insert or the commit, is the one that
// fails), in every mode, on database/sql (PostgreSQL, MariaDB) and pgx. The
// database going away is not the message's fault: the message is not
// dead-lettered, no run of any message sees an attempt beyond the first,
// the key's attempt count in the claims table is 1 once it commits, and
// every effect and outbox row lands exactly once. Behind the dedupe
// middleware (the default mode) the three losses are run again in place,
// under the same claim; in the one-statement and batch modes five losses
// also exhaust the reruns of a delivery, which is deferred and redelivered.
func TestTransactionLosingItsConnectionSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	for _, d := range lossDrivers() {
		for _, mode := range []lossMode{lossDefault, lossOneStatement, lossBatch} {
			for _, point := range []string{"mid-handler", "after-handler"} {
				t.Run(d.name+"/"+string(mode)+"/"+point, func(t *testing.T) {
					t.Parallel()
					testConnectionLoss(t, d.open(t), mode, point)
				})
			}
		}
	}
}

func testConnectionLoss(t *testing.T, db lossDB, mode lossMode, point string) {
	a := newBatchAMQP(t, "connloss")
	losses := int64(3) // within one delivery's reruns
	if mode != lossDefault {
		losses = 5 // more than a delivery's reruns: deferred and redelivered
	}
	const n = 5
	victim := fmt.Sprintf("cl-%d", n-1) // the last key of any batch it is in
	var (
		kills    atomic.Int64
		killErr  atomic.Value
		mu       sync.Mutex
		attempts = map[string][]int{} // the attempt each run of a message saw
	)
	body := func(ctx context.Context, msg *message.Message, tx lossTx, out message.Publisher) error {
		mu.Lock()
		attempts[msg.UUID] = append(attempts[msg.UUID], settle.SettlementFromContext(msg.Context()).Attempt())
		mu.Unlock()
		lose := func() {
			if msg.UUID == victim && kills.Load() < losses {
				kills.Add(1)
				if err := tx.kill(); err != nil {
					killErr.Store(err)
				}
			}
		}
		if point == "mid-handler" {
			lose()
		}
		if err := out.Publish("receipts", message.NewMessage("receipt-"+msg.UUID, msg.Payload)); err != nil {
			return err
		}
		if err := tx.insert(msg.UUID); err != nil {
			return err
		}
		if point == "after-handler" {
			lose()
		}
		return nil
	}
	runLossPipeline(t, a, db, mode, body)
	a.publishOrders(t, "cl", n)

	parked := func() (int, int) { return a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison") }
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, distinct := db.effects(t)
		dl, ps := parked()
		if distinct+dl+ps >= n || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // anything doubled arrives by then
	if err, _ := killErr.Load().(error); err != nil {
		t.Fatalf("the test could not kill the backend: %v", err)
	}
	total, distinct := db.effects(t)
	rows := db.outbox(t)
	dl, ps := parked()
	mu.Lock()
	seen := attempts[victim]
	mu.Unlock()
	t.Logf("%d connections lost; the victim's runs saw attempts %v", kills.Load(), seen)
	if total != n || distinct != n || rows != n || dl != 0 || ps != 0 {
		t.Fatalf("effects=%d distinct=%d outbox rows=%d dead-lettered=%d poisoned=%d; want %d effects, each once, %d rows, none parked",
			total, distinct, rows, dl, ps, n, n)
	}
	if k := kills.Load(); k != losses {
		t.Fatalf("%d losses, want %d", k, losses)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != int(losses)+1 {
		t.Errorf("the victim ran %d times, want %d (each loss, then the run that commits)", len(seen), losses+1)
	}
	for id, runs := range attempts {
		for _, at := range runs {
			if at != 1 {
				t.Errorf("a run of %s saw attempt %d (runs: %v): a lost connection was counted as an attempt", id, at, runs)
				break
			}
		}
	}
	if state, att := db.claim(t, dedupe.ScopedKey("charge", victim)); state != 2 || att != 1 {
		t.Errorf("the victim's key: state %d, attempts %d; want confirmed (2) on its first attempt", state, att)
	}
}

// lossDrivers are the databases and drivers the connection tests run on.
func lossDrivers() []struct {
	name string
	open func(t *testing.T) lossDB
} {
	return []struct {
		name string
		open func(t *testing.T) lossDB
	}{
		{"postgres", func(t *testing.T) lossDB { return lossDBOn(t, stdOf(testenv.Postgres(t)), testenv.Postgres(t)) }},
		{"mysql", func(t *testing.T) lossDB { return lossDBOn(t, stdOf(testenv.MySQL(t)), testenv.MySQL(t)) }},
		{"pgx", func(t *testing.T) lossDB { return lossDBOn(t, pgxDB(t), testenv.Postgres(t)) }},
	}
}

// runLossPipeline runs a router with db's handler in mode on a's queue.
func runLossPipeline(t *testing.T, a *batchAMQP, db lossDB, mode lossMode, body lossBody) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	concurrency := 1
	if mode == lossBatch {
		concurrency = 4
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Store: db.store, Concurrency: concurrency,
		Retry: fastRetry(), DisableTracing: true, BusyDelay: 20 * time.Millisecond})
	must(t, err)
	must(t, db.add(p, a.src, a.sub, mode, body))
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
	})
}

// Errors that look like a lost connection but are not the transaction's
// stay the handler's failures: a *net.OpError of the handler's own call to
// another service, an io.EOF of its own reading, and a query the database
// refuses (on PostgreSQL it aborts the transaction, whose connection still
// answers). Each is an attempt: the message runs MaxAttempts times, seeing
// attempts 1, 2, 3, and is dead-lettered; the good messages commit once.
func TestHandlerErrorsStayAttemptsBesideConnectionLoss(t *testing.T) {
	t.Parallel()
	for _, d := range lossDrivers() {
		for _, mode := range []lossMode{lossDefault, lossOneStatement, lossBatch} {
			t.Run(d.name+"/"+string(mode), func(t *testing.T) {
				t.Parallel()
				db := d.open(t)
				a := newBatchAMQP(t, "ownerr")
				refused := func() error {
					c, err := net.DialTimeout("tcp", closedAddr(t), 5*time.Second)
					if err == nil {
						_ = c.Close()
						return errors.New("the closed port accepted a connection")
					}
					return fmt.Errorf("call the card service: %w", err)
				}
				var mu sync.Mutex
				attempts := map[string][]int{}
				runLossPipeline(t, a, db, mode, func(ctx context.Context, msg *message.Message, tx lossTx, out message.Publisher) error {
					mu.Lock()
					attempts[msg.UUID] = append(attempts[msg.UUID], settle.SettlementFromContext(msg.Context()).Attempt())
					mu.Unlock()
					if err := tx.insert(msg.UUID); err != nil {
						return err
					}
					switch msg.UUID {
					case "own-net":
						return refused()
					case "own-eof":
						return fmt.Errorf("read the card service's reply: %w", io.EOF)
					case "own-query":
						return tx.badQuery()
					}
					return out.Publish("receipts", message.NewMessage("receipt-"+msg.UUID, msg.Payload))
				})
				ids := []string{"good-0", "own-net", "own-eof", "own-query", "good-1"}
				for _, id := range ids {
					must(t, a.pub.Publish(a.src, message.NewMessage(id, []byte(id))))
				}
				deadline := time.Now().Add(60 * time.Second)
				for {
					_, distinct := db.effects(t)
					if distinct+a.depth(t, a.src+".dead_letter") >= len(ids) || time.Now().After(deadline) {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				time.Sleep(300 * time.Millisecond)
				total, distinct := db.effects(t)
				dl, ps := a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison")
				if total != 2 || distinct != 2 || db.outbox(t) != 2 || dl != 3 || ps != 0 {
					t.Fatalf("effects=%d distinct=%d outbox=%d dead-lettered=%d poisoned=%d; want the 2 good messages once and the 3 failing ones dead-lettered",
						total, distinct, db.outbox(t), dl, ps)
				}
				mu.Lock()
				defer mu.Unlock()
				for _, id := range []string{"own-net", "own-eof", "own-query"} {
					if got := fmt.Sprint(attempts[id]); got != "[1 2 3]" {
						t.Errorf("%s ran with attempts %s, want [1 2 3]: its own error must count", id, got)
					}
				}
			})
		}
	}
}

// closedAddr is a TCP address on 127.0.0.1 that nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	addr := l.Addr().String()
	must(t, l.Close())
	return addr
}

// A database that refuses every connection (here: a port nothing listens
// on) never runs the handler and never loops hot: every delivery, redelivered
// at once as RabbitMQ does, is deferred after BusyDelay (the dedupe
// middleware's UnavailableDelay in the default mode, where its claim is the
// first statement), so the deliveries of a second are bounded by it.
func TestRefusingDatabaseDefersAfterTheDelay(t *testing.T) {
	t.Parallel()
	const delay = 100 * time.Millisecond
	for _, mode := range []lossMode{lossDefault, lossOneStatement, lossBatch} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			db, dialect, err := sqlurl.Open("postgres://postgres@" + closedAddr(t) + "/test?sslmode=disable&connect_timeout=5")
			must(t, err)
			t.Cleanup(func() { _ = db.Close() })
			driver := sqldb.Std(db, dialect)
			store, err := dedupe.NewSQLStore(driver, dedupe.SQLConfig{Table: "dd_refused"})
			must(t, err)
			var runs atomic.Int64
			cfg := pipeline.TxConfig[*sql.Tx]{DB: driver, Store: store, BusyDelay: delay}
			txConfigIn(mode, &cfg)
			h, err := pipeline.NewTxHandler(cfg, func(context.Context, *sql.Tx, *message.Message, message.Publisher) error {
				runs.Add(1)
				return nil
			})
			must(t, err)
			deliver := func(msg *message.Message) error { return h(msg) }
			if mode == lossDefault {
				dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, UnavailableDelay: delay, MaxUnavailableDelay: delay})
				must(t, err)
				wrapped := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
				deliver = func(msg *message.Message) error { _, err := wrapped(msg); return err }
			}
			deliveries := 0
			for start := time.Now(); time.Since(start) < time.Second; deliveries++ {
				msg := message.NewMessage("refused-1", nil)
				ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
				msg.SetContext(ctx)
				err := deliver(msg)
				cancel()
				if !errors.Is(err, dedupe.ErrUnavailable) {
					t.Fatalf("delivery %d: %v, want an error wrapping dedupe.ErrUnavailable", deliveries+1, err)
				}
			}
			if n := runs.Load(); n != 0 {
				t.Fatalf("the handler ran %d times against a database that refuses connections", n)
			}
			if maxN := int(time.Second/delay) + 1; deliveries > maxN {
				t.Fatalf("%d deliveries in a second, want at most %d: a refused connection must wait %v before the nack", deliveries, maxN, delay)
			}
			t.Logf("%d deliveries in a second, each deferred", deliveries)
		})
	}
}
