package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// ConfirmTx confirms in the handler's transaction, on every driver: a
// rollback takes the confirmation with it (the key is released, and the
// redelivery does the work), a commit makes it final.
func TestConfirmTxCommitsAndRollsBackWithTheTransaction(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run("std-"+d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			confirmTxCase(t, db, db.Driver())
		})
	}
	t.Run("pgx-postgres", func(t *testing.T) {
		t.Parallel()
		confirmTxCase(t, testenv.Postgres(t), testenv.Pgx(t))
	})
}

func confirmTxCase[TTx any](t *testing.T, db testenv.DB, drv sqldb.Driver[TTx]) {
	table := testenv.DedupeTable(t, db)
	store, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	fx := newTxFixture(t, db, table)
	mw := newMiddleware(t, dedupe.Config{Store: store})
	// handle runs the message behind the middleware in a transaction that
	// writes its effect, confirms with ConfirmTx, then commits, or rolls
	// back when fail.
	handle := func(id string, fail bool) error {
		h := mw(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := drv.Begin(ctx, nil, "")
			if err != nil {
				return nil, err
			}
			defer func() { _ = drv.Rollback(context.Background(), tx) }()
			if err := fx.effect(ctx, drv.Tx(tx), id); err != nil {
				return nil, err
			}
			if err := dedupe.ConfirmTx(ctx, tx); err != nil {
				return nil, err
			}
			if fail {
				return nil, errors.New("the handler fails after its confirmation")
			}
			return nil, drv.Commit(ctx, tx)
		})
		_, err := h(message.NewMessage(id, nil))
		return err
	}
	if err := handle("m-1", true); err == nil {
		t.Fatal("the failed handler's error was lost")
	}
	c, err := store.Claim(t.Context(), "m-1", time.Minute)
	if err != nil || c.Result != dedupe.Acquired || c.Attempt != 2 {
		t.Fatalf("after a rolled-back ConfirmTx: %v (attempt %d), %v; want the key free, acquired at attempt 2", c.Result, c.Attempt, err)
	}
	if err := store.Release(t.Context(), c); err != nil {
		t.Fatal(err)
	}
	if n, err := fx.count(t.Context(), "m-1"); err != nil || n != 0 {
		t.Fatalf("%d effects of the rolled-back attempt (%v), want 0", n, err)
	}
	if err := handle("m-1", false); err != nil {
		t.Fatalf("the redelivery: %v", err)
	}
	if c, err := store.Claim(t.Context(), "m-1", time.Minute); err != nil || c.Result != dedupe.Duplicate {
		t.Fatalf("after a committed ConfirmTx: %v, %v; want duplicate", c.Result, err)
	}
	if n, err := fx.count(t.Context(), "m-1"); err != nil || n != 1 {
		t.Fatalf("%d effects (%v), want 1", n, err)
	}
}

// ConfirmTx and HoldTx of a transaction whose type is not the store's
// refuse with an error naming both types, and leave the claim as it was.
func TestConfirmTxRefusesATransactionOfAnotherDriver(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	drv := testenv.Pgx(t)
	mw := newMiddleware(t, dedupe.Config{Store: store})
	var confirmErr, holdErr error
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		tx, err := drv.Begin(msg.Context(), nil, "")
		if err != nil {
			return nil, err
		}
		defer func() { _ = drv.Rollback(context.Background(), tx) }()
		holdErr = dedupe.HoldTx(msg.Context(), tx)
		confirmErr = dedupe.ConfirmTx(msg.Context(), tx)
		return nil, confirmErr
	})
	if _, err := h(message.NewMessage("x-1", nil)); err == nil {
		t.Fatal("the handler's error was lost")
	}
	for _, err := range []error{holdErr, confirmErr} {
		if err == nil || !strings.Contains(err.Error(), "*dedupe.SQLStore[pgx.Tx]") || !strings.Contains(err.Error(), "*dedupe.SQLStore[*sql.Tx]") {
			t.Errorf("err = %v; want one naming *dedupe.SQLStore[pgx.Tx] and *dedupe.SQLStore[*sql.Tx]", err)
		}
	}
	if c, err := store.Claim(t.Context(), "x-1", time.Minute); err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("after the refused confirmation: %v, %v; want the key released", c.Result, err)
	}
	// With no claim in the context.
	if err := dedupe.ConfirmTx[*sql.Tx](t.Context(), nil); !errors.Is(err, dedupe.ErrNoClaim) {
		t.Fatalf("ConfirmTx without a claim: %v, want ErrNoClaim", err)
	}
}
