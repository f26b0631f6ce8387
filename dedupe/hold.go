package dedupe

import (
	"context"
	"errors"
	"fmt"
)

// holdIn hands the claim in ctx to the caller's transaction, whose
// statements ex runs; see HoldTx.
func holdIn(ctx context.Context, ex executor) error {
	st, ok := ctx.Value(heldCtxKey{}).(*held)
	if !ok {
		return ErrNoClaim
	}
	sb, ok := st.store.(sqlBacked)
	if !ok {
		return nil // nothing to hand over: the renewal goes on beside
	}
	s := sb.sqlStore()
	if _, pgx := ex.(pgxExec); pgx && s.dialect != Postgres {
		return fmt.Errorf("dedupe: holding a claim in a pgx.Tx needs a store of the Postgres dialect, not %s", s.dialect)
	}
	switch s.dialect {
	case SQLite:
		st.stopRenew()
		ctx, cancel := st.bounded(ctx)
		defer cancel()
		if err := s.on(ex).Renew(ctx, st.claim, st.ttl); err != nil {
			return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
		}
		return nil
	case Postgres:
		return holdPostgres(ctx, st, s.on(ex))
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
func holdPostgres(ctx context.Context, st *held, s *SQLStore) error {
	if err := checkOwned(st.claim); err != nil {
		return err
	}
	ctx, cancel := st.bounded(ctx)
	defer cancel()
	var level string
	if err := s.ex.queryRow(ctx, "SHOW transaction_isolation", nil, &level); err != nil {
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
