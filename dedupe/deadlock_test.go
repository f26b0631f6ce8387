package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// Inside a caller's transaction a deadlock rolled the whole transaction
// back: the store must hand the deadlock to the caller, not run the
// statement again in the aborted transaction. On both PostgreSQL drivers.
func TestDeadlockInTxGoesToTheCaller(t *testing.T) {
	t.Parallel()
	t.Run("std-postgres", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		deadlockInTx(t, db, db.Driver())
	})
	t.Run("pgx-postgres", func(t *testing.T) {
		t.Parallel()
		deadlockInTx[pgx.Tx](t, testenv.Postgres(t), testenv.Pgx(t))
	})
}

func deadlockInTx[TTx any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx]) {
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	begin := func() TTx {
		tx, err := drv.Begin(ctx, &sql.TxOptions{}, "")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = drv.Rollback(context.Background(), tx) })
		return tx
	}
	tx1, tx2 := begin(), begin()
	s1, s2 := store.WithTx(tx1), store.WithTx(tx2)
	if _, err := s1.ClaimConfirmed(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s2.ClaimConfirmed(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	// Each now waits for the other's key.
	errs := make(chan error, 2)
	go func() {
		_, err := s1.ClaimConfirmed(ctx, "b")
		_ = drv.Rollback(context.Background(), tx1)
		errs <- err
	}()
	go func() {
		_, err := s2.ClaimConfirmed(ctx, "a")
		_ = drv.Rollback(context.Background(), tx2)
		errs <- err
	}()
	var deadlocks int
	for range 2 {
		err := <-errs
		var pe interface{ SQLState() string }
		switch {
		case err == nil:
		case errors.As(err, &pe) && pe.SQLState() == "40P01":
			deadlocks++
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	if deadlocks != 1 {
		t.Fatalf("%d deadlock errors reached the callers, want 1", deadlocks)
	}
}
