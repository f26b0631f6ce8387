package dedupe_test

import (
	"context"
	"errors"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// BenchmarkConfirmInTx measures, at 16 goroutines on PostgreSQL, the
// database's part of a transactional handler behind the middleware: the
// claim, then BEGIN; the effect; the confirmation; COMMIT. "wait" claims as
// a plain handler does, "lease" as with Config.ConfirmInTx; "hand" is the
// exactly-once transaction written by hand (BEGIN; INSERT the key ON
// CONFLICT DO NOTHING; the effect; COMMIT), in the same run:
//
//	go test -run '^$' -bench ConfirmInTx -count 5 ./dedupe/
func BenchmarkConfirmInTx(b *testing.B) {
	const g = 16
	db := testenv.Postgres(b)
	db.SetMaxOpenConns(2 * g)
	db.SetMaxIdleConns(2 * g)
	drv := db.Driver()
	flow := func(lease bool) func(b *testing.B) {
		return func(b *testing.B) {
			table := testenv.DedupeTable(b, db)
			store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
			if err != nil {
				b.Fatal(err)
			}
			fx := newTxFixture(b, db, table)
			runConcurrent(b, g, func(ctx context.Context, key string) error {
				cctx := ctx
				if lease {
					cctx = dedupe.AsLease(ctx)
				}
				c, err := store.Claim(cctx, key, benchTTL)
				if err != nil {
					return err
				}
				if c.Result != dedupe.Acquired {
					return errors.New("fresh key " + key + " not acquired: " + c.Result.String())
				}
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback() }()
				if err := fx.effect(ctx, drv.Tx(tx), key); err != nil {
					return err
				}
				if err := store.WithTx(tx).Confirm(ctx, c); err != nil {
					return err
				}
				return tx.Commit()
			})
		}
	}
	b.Run("wait", flow(false))
	b.Run("lease", flow(true))
	b.Run("hand", func(b *testing.B) {
		keys := testenv.Name(b, "keys")
		if _, err := db.ExecContext(b.Context(), "CREATE TABLE "+keys+" (key TEXT PRIMARY KEY)"); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+keys) })
		fx := newTxFixture(b, db, keys)
		claim := "INSERT INTO " + keys + " (key) VALUES ($1) ON CONFLICT DO NOTHING"
		runConcurrent(b, g, func(ctx context.Context, key string) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			res, err := tx.ExecContext(ctx, claim, key)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil || n != 1 {
				return errors.Join(err, errors.New("fresh key "+key+" not inserted"))
			}
			if err := fx.effect(ctx, drv.Tx(tx), key); err != nil {
				return err
			}
			return tx.Commit()
		})
	})
}
