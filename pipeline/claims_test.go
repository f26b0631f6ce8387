package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// storeCase is a dedupe store of every kind a test runs against.
type storeCase struct {
	name string
	open func(t *testing.T) (dedupe.Store, testenv.DB)
}

func storeCases() []storeCase {
	cases := []storeCase{{"memory", func(*testing.T) (dedupe.Store, testenv.DB) { return dedupe.NewMemoryStore(), testenv.DB{} }}}
	for _, d := range testenv.Databases() {
		cases = append(cases, storeCase{d.Name, func(t *testing.T) (dedupe.Store, testenv.DB) {
			db := d.Open(t)
			return claimsTable(t, stdOf(db)), db
		}})
	}
	return append(cases, storeCase{"pgx", func(t *testing.T) (dedupe.Store, testenv.DB) {
		d := pgxDB(t)
		return claimsTable(t, d), d.sql
	}})
}

// runCounter counts handler runs per (handler, message).
type runCounter struct {
	mu   sync.Mutex
	runs map[string]int
}

func (c *runCounter) add(handler, uuid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[string]int{}
	}
	c.runs[handler+"/"+uuid]++
}

func (c *runCounter) get(handler, uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[handler+"/"+uuid]
}

// Two handlers consume the same messages (GoChannel gives every subscription
// every message) through one Pipeline and one store. Each is its own piece
// of work: each runs once per message, however often the message comes.
func TestTwoHandlersOfOneMessageEachRunOnce(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, _ := sc.open(t)
			h := newHarness(t, store)
			var runs runCounter
			for _, name := range []string{"charge", "email"} {
				_, err := h.p.Handle(name, "orders", h.pubsub, func(msg *message.Message) error {
					runs.add(name, msg.UUID)
					return nil
				})
				must(t, err)
			}
			h.run(t)
			const n = 10
			var uuids []string
			for i := range n {
				uuid := fmt.Sprintf("order-%d-%s", i, watermill.NewShortUUID())
				uuids = append(uuids, uuid)
				for range 2 { // delivered twice, as after a redelivery
					must(t, h.pubsub.Publish("orders", message.NewMessage(uuid, []byte("{}"))))
				}
			}
			waitFor(t, "both handlers ran every message", func() bool {
				for _, u := range uuids {
					if runs.get("charge", u) == 0 || runs.get("email", u) == 0 {
						return false
					}
				}
				return true
			})
			time.Sleep(100 * time.Millisecond) // let the second deliveries settle
			for _, u := range uuids {
				for _, name := range []string{"charge", "email"} {
					if got := runs.get(name, u); got != 1 {
						t.Errorf("%s ran %d times for %s, want 1", name, got, u)
					}
					c, err := store.Claim(t.Context(), dedupe.ScopedKey(name, u), time.Minute)
					must(t, err)
					if c.Result != dedupe.Duplicate {
						t.Errorf("key of %s in %s's scope is %v, want confirmed", u, name, c.Result)
					}
				}
			}
		})
	}
}

// SharedScope makes two handlers share their keys on purpose: whichever runs
// first does the work, the other sees a duplicate.
func TestSharedScopeRunsOneOfTwoHandlers(t *testing.T) {
	t.Parallel()
	store := dedupe.NewMemoryStore()
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	must(t, err)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, Scope: dedupe.SharedScope("notify")})
	must(t, err)
	var runs atomic.Int64
	for _, name := range []string{"sms", "push"} {
		router.AddConsumerHandler(name, "alerts", ps, func(*message.Message) error {
			runs.Add(1)
			return nil
		}).AddMiddleware(dd)
	}
	h := &harness{pubsub: ps, router: router}
	h.run(t)
	must(t, ps.Publish("alerts", message.NewMessage("alert-1", nil)))
	waitFor(t, "one handler ran", func() bool { return runs.Load() > 0 })
	time.Sleep(200 * time.Millisecond) // the other handler's delivery settles as a duplicate
	if n := runs.Load(); n != 1 {
		t.Fatalf("handlers sharing a scope ran %d times, want 1", n)
	}
}

// A transactional handler that panics: its transaction is rolled back, so
// the in-process retry (which claims the key again, in one-statement mode
// inside a new transaction) is not blocked by it, and the effect lands once.
func TestTxHandlerPanicRollsBackAndRetries(t *testing.T) {
	t.Parallel()
	onEachDriver(t, txHandlerPanicRollsBackAndRetries[*sql.Tx], txHandlerPanicRollsBackAndRetries[pgx.Tx])
}

func txHandlerPanicRollsBackAndRetries[TTx any](t *testing.T, d db[TTx]) {
	for _, one := range []bool{false, true} {
		t.Run(fmt.Sprintf("one_statement=%v", one), func(t *testing.T) {
			e := newTxEnv(t, d)
			h := newHarness(t, e.store)
			var calls atomic.Int64
			_, err := pipeline.HandleTx(h.p, "charge", "orders", h.pubsub, pipeline.TxConfig[TTx]{DB: d.Driver, OneStatement: one},
				func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
					if _, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ("+d.ph(1)+", 1)", msg.UUID); err != nil {
						return err
					}
					if calls.Add(1) == 1 {
						panic("handler bug")
					}
					return nil
				})
			must(t, err)
			h.run(t)
			must(t, h.pubsub.Publish("orders", message.NewMessage("panics-once", nil)))
			waitFor(t, "the retry committed", func() bool { return e.rows(t) == 1 })
			time.Sleep(50 * time.Millisecond)
			if n := calls.Load(); n != 2 {
				t.Fatalf("handler ran %d times, want 2 (a panic, then the retry)", n)
			}
			if n := e.rows(t); n != 1 {
				t.Fatalf("%d charges, want 1", n)
			}
		})
	}
}

// A SQLite transactional handler holds the database's write lock for as
// long as it runs. It must still finish on its first attempt when it runs
// far longer than the claim timeout.
func TestSQLiteTxHandlerOutlivesClaimTimeout(t *testing.T) {
	t.Parallel()
	e := newTxEnv(t, stdOf(testenv.SQLite(t)))
	h := newHarnessWith(t, e.store, func(c *pipeline.Config) { c.ClaimTimeout = 150 * time.Millisecond })
	var calls atomic.Int64
	var handlerErr atomic.Value
	_, err := pipeline.HandleTx(h.p, "slow", "orders", h.pubsub, pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			calls.Add(1)
			if _, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES (?, 1)", msg.UUID); err != nil {
				return err
			}
			select {
			case <-time.After(time.Second): // nearly 7 claim timeouts
				return nil
			case <-ctx.Done():
				handlerErr.Store(context.Cause(ctx))
				return ctx.Err()
			}
		})
	must(t, err)
	h.run(t)
	must(t, h.pubsub.Publish("orders", message.NewMessage("slow-1", nil)))
	waitFor(t, "the slow handler committed", func() bool { return e.rows(t) == 1 })
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1 (cancelled: %v)", n, handlerErr.Load())
	}
}

// A transactional handler whose claim is lost while it runs (here: the row
// is deleted under it, as a takeover after expiry would) is cancelled; the
// error it returns is whatever its driver says about the cancelled context,
// and the middleware's result must still be ErrClaimLost. Its writes roll
// back.
func TestTxHandlerLostClaimIsErrClaimLost(t *testing.T) {
	t.Parallel()
	onPostgres(t, txHandlerLostClaimIsErrClaimLost[*sql.Tx], txHandlerLostClaimIsErrClaimLost[pgx.Tx])
}

func txHandlerLostClaimIsErrClaimLost[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: e.store, ClaimTimeout: 300 * time.Millisecond, RenewInterval: 50 * time.Millisecond})
	must(t, err)
	txh, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver}, func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
		if _, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 1)", msg.UUID); err != nil {
			return err
		}
		c, _ := dedupe.ClaimFromContext(ctx)
		// Another worker's takeover, as the store sees it: the token changes.
		if _, err := d.sql.ExecContext(context.Background(), `UPDATE "`+e.claims+`" SET token = 'someone-else' WHERE key = $1`, []byte(c.Key)); err != nil {
			return err
		}
		_, err := d.Tx(tx).Exec(ctx, "SELECT pg_sleep(5)")
		return err
	})
	must(t, err)
	_, err = dd(func(msg *message.Message) ([]*message.Message, error) { return nil, txh(msg) })(message.NewMessage("lost-1", nil))
	if !errors.Is(err, dedupe.ErrClaimLost) {
		t.Fatalf("err = %v, want one that is ErrClaimLost", err)
	}
	if n := e.rows(t); n != 0 {
		t.Fatalf("%d charges after a lost claim, want 0", n)
	}
}
