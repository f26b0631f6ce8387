package dedupe_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// Inside a caller's pgx.Tx a deadlock rolled the whole transaction back: the
// store must hand the deadlock to the caller, not run the statement again in
// the aborted transaction.
func TestPgxStoreDeadlockInTxGoesToTheCaller(t *testing.T) {
	t.Parallel()
	db, pool := testenv.Postgres(t), testenv.PgxPool(t)
	store, err := dedupe.NewPgxStore(pool, dedupe.PgxConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	tx1, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx1.Rollback(context.Background()) }()
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx2.Rollback(context.Background()) }()
	s1, s2 := store.WithTx(tx1), store.WithTx(tx2)
	if _, err := s1.ClaimConfirmed(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s2.ClaimConfirmed(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	// Each now waits for the other's key.
	errs := make(chan error, 2)
	go func() { _, err := s1.ClaimConfirmed(ctx, "b"); _ = tx1.Rollback(context.Background()); errs <- err }()
	go func() { _, err := s2.ClaimConfirmed(ctx, "a"); _ = tx2.Rollback(context.Background()); errs <- err }()
	var deadlocks int
	for range 2 {
		err := <-errs
		var pe *pgconn.PgError
		switch {
		case err == nil:
		case errors.As(err, &pe) && pe.Code == "40P01":
			deadlocks++
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	if deadlocks != 1 {
		t.Fatalf("%d deadlock errors reached the callers, want 1", deadlocks)
	}
}

func TestPgxConfigIsChecked(t *testing.T) {
	t.Parallel()
	pool := testenv.PgxPool(t)
	for _, c := range []struct {
		cfg  dedupe.PgxConfig
		want string
	}{
		{dedupe.PgxConfig{Table: "no-dashes"}, "PgxConfig.Table"},
		{dedupe.PgxConfig{PruneBatch: -1}, "PgxConfig.PruneBatch"},
	} {
		if _, err := dedupe.NewPgxStore(pool, c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err = %v, want one naming %s", c.cfg, err, c.want)
		}
	}
	if _, err := dedupe.NewPgxStore(nil, dedupe.PgxConfig{}); err == nil {
		t.Error("a nil db was accepted")
	}
}
