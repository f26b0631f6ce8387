package dedupe_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// holdCase is one driver's way of running a handler's own transaction
// behind the middleware: begin at iso, HoldTx, then inside, ConfirmTx and
// commit.
type holdCase struct {
	name string
	// setup returns the store on a claims table, and run, which runs a
	// handler's transaction on the same driver.
	setup func(t *testing.T, db testenv.DB, table string) (dedupe.Store, holdRun)
}

type holdRun func(ctx context.Context, iso string, inside func(ctx context.Context) error) error

var holdLevels = map[string]sql.IsolationLevel{"read committed": sql.LevelReadCommitted, "repeatable read": sql.LevelRepeatableRead, "serializable": sql.LevelSerializable}

// holdCaseOn is the holdCase of the driver open returns: the same code for
// every driver.
func holdCaseOn[TTx any](name string, open func(t *testing.T, db testenv.DB) sqldb.Driver[TTx]) holdCase {
	return holdCase{name, func(t *testing.T, db testenv.DB, table string) (dedupe.Store, holdRun) {
		drv := open(t, db)
		s, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		return s, func(ctx context.Context, iso string, inside func(ctx context.Context) error) error {
			tx, err := drv.Begin(ctx, &sql.TxOptions{Isolation: holdLevels[iso]}, "")
			if err != nil {
				return err
			}
			defer func() { _ = drv.Rollback(context.Background(), tx) }()
			if err := dedupe.HoldTx(ctx, tx); err != nil {
				return err
			}
			if err := drv.Tx(tx).QueryRow(ctx, "SELECT 1", nil, new(int)); err != nil {
				return err
			}
			if err := inside(ctx); err != nil {
				return err
			}
			if err := dedupe.ConfirmTx(ctx, tx); err != nil {
				return err
			}
			return drv.Commit(ctx, tx)
		}
	}}
}

func holdCases() []holdCase {
	return []holdCase{
		holdCaseOn("database/sql", func(_ *testing.T, db testenv.DB) sqldb.Driver[*sql.Tx] { return db.Driver() }),
		holdCaseOn("pgx", func(t *testing.T, _ testenv.DB) sqldb.Driver[pgx.Tx] { return testenv.Pgx(t) }),
	}
}

// A handler's own transaction on PostgreSQL, begun at REPEATABLE READ or
// SERIALIZABLE with HoldTx as its first statement, outlives
// three renewals of its claim and confirms: the transaction holds the
// claim's row, and no renewal writes it after the snapshot. Without the
// hold, ConfirmTx failed with a serialization failure every time. While it
// is held, another claim of the key waits on the row: cut short by its
// deadline, it gets no answer (and the delivery would be deferred), never
// the key. At READ COMMITTED the renewal goes on beside the transaction and
// another claim of the key is told Busy at once.
func TestHoldTxOnPostgresAtEveryIsolationLevel(t *testing.T) {
	t.Parallel()
	for _, c := range holdCases() {
		for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
			t.Run(c.name+"/"+iso, func(t *testing.T) {
				t.Parallel()
				db := testenv.Postgres(t)
				store, run := c.setup(t, db, testenv.DedupeTable(t, db))
				// A claim timeout of 2s renewed every 150ms: at READ COMMITTED the
				// renewals go on beside the transaction, and on a loaded machine
				// (a PostgreSQL round trip under -race beside other packages'
				// tests) one took longer than the 450ms a timeout of 600ms left
				// it, the claim lapsed, and the handler was cancelled. The
				// handler outlives the timeout all the same.
				const claimTimeout = 2 * time.Second
				mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: claimTimeout, RenewInterval: 150 * time.Millisecond})
				if err != nil {
					t.Fatal(err)
				}
				uuid := watermill.NewUUID()
				key, err := dedupe.MessageKey(newMsg(t, uuid), nil, nil)
				if err != nil {
					t.Fatal(err)
				}
				runs := 0
				h := mw(func(msg *message.Message) ([]*message.Message, error) {
					runs++
					return nil, run(msg.Context(), iso, func(ctx context.Context) error {
						time.Sleep(claimTimeout + 100*time.Millisecond) // past the claim timeout: renewals, or the hold, keep it
						// Another worker's claim of the key. Where the transaction
						// holds the row it waits on it: cut short after 300ms, it
						// must get no answer. At READ COMMITTED it must be told
						// Busy without waiting, in whatever time a loaded machine
						// takes to ask (300ms was not always enough).
						wait := 300 * time.Millisecond
						if iso == "read committed" {
							wait = claimTimeout
						}
						cctx, cancel := context.WithTimeout(ctx, wait)
						defer cancel()
						other, err := store.Claim(cctx, key, time.Minute)
						switch {
						case iso == "read committed" && (err != nil || other.Result != dedupe.Busy):
							t.Errorf("another claim at read committed: %v, %v; want Busy at once", other.Result, err)
						case iso != "read committed" && err == nil:
							t.Errorf("another claim while the transaction holds the key: %v; want it to wait on the row", other.Result)
						}
						return nil
					})
				})
				if _, err := h(newMsg(t, uuid)); err != nil {
					t.Fatalf("handler's transaction: %v", err)
				}
				claim, err := store.Claim(t.Context(), key, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if runs != 1 || claim.Result != dedupe.Duplicate || claim.Attempt != 1 {
					t.Errorf("ran %d times; key %v after %d attempts, want confirmed after one run", runs, claim.Result, claim.Attempt)
				}
			})
		}
	}
}
