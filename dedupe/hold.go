package dedupe

import (
	"context"
	"errors"
	"fmt"

	"github.com/settle-go/settle/sqldb"
)

// holdIn hands the claim in ctx to tx, the caller's transaction; see HoldTx.
func holdIn[TTx any](ctx context.Context, tx TTx) error {
	st, ok := ctx.Value(heldCtxKey{}).(*held)
	if !ok {
		return ErrNoClaim
	}
	s, err := txStore[TTx](st, "holding a claim in")
	if err != nil {
		if _, sql := st.store.(sqlBacked); !sql {
			return nil // nothing to hand over: the renewal goes on beside
		}
		return err
	}
	s = s.WithTx(tx)
	switch s.dialect {
	case sqldb.SQLite:
		st.stopRenew()
		ctx, cancel := st.bounded(ctx)
		defer cancel()
		if err := s.Renew(ctx, st.claim, st.ttl); err != nil {
			return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
		}
		return nil
	case sqldb.Postgres:
		return holdPostgres(ctx, st, s)
	}
	return nil
}

// holdPostgres holds the claim of st in the transaction s runs on, if the
// transaction reads a snapshot (REPEATABLE READ, SERIALIZABLE).
//
// SHOW asks the transaction's isolation level without taking the snapshot
// or touching the claims table. At READ COMMITTED, where each statement
// reads the latest rows, that is all: the renewal goes on beside the
// transaction, and the table is not locked until the confirmation (a
// migration's ALTER TABLE is not held up by every running handler). At the
// other two levels the renewal is paused, a renewal in flight let finish,
// and the claim renewed in the transaction: that UPDATE takes the snapshot
// and locks the row until the transaction ends, so no one else writes it
// before the confirmation does. A renewal landing after the snapshot would
// have made every later UPDATE of the row in the transaction fail with a
// serialization failure.
func holdPostgres[TTx any](ctx context.Context, st *held, s *SQLStore[TTx]) error {
	if err := checkOwned(st.claim); err != nil {
		return err
	}
	ctx, cancel := st.bounded(ctx)
	defer cancel()
	var level string
	if err := s.ex.QueryRow(ctx, "SHOW transaction_isolation", nil, &level); err != nil {
		return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
	}
	if level != "repeatable read" && level != "serializable" {
		return nil
	}
	st.ren.pause(ctx)
	err := s.Renew(ctx, st.claim, st.ttl)
	if err != nil && !errors.Is(err, ErrClaimLost) {
		st.ren.resume() // the transaction holds nothing
		return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
	}
	// The transaction holds the row, or the claim is someone else's:
	// either way the background renewal has nothing left to do.
	st.stopRenew()
	if err != nil {
		return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
	}
	return nil
}
