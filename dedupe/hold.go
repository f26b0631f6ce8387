package dedupe

import (
	"context"
	"errors"
	"fmt"

	"github.com/settle-go/settle/internal/sqlkit"
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
// The level is the one a pipeline transaction set at BEGIN (its
// sqlkit.TxHints), or, for a pipeline transaction at the session's
// default, the one the last such transaction's confirmation found (a
// column of that statement): no round trip. Otherwise (the first such
// transaction, a rerun after ErrGuessedLevel, or HoldTx called by hand) it
// is asked with SHOW, which takes neither the snapshot nor a lock. At READ
// COMMITTED, where each statement reads the latest rows, that is all: the
// renewal goes on beside the transaction, and the table is not locked
// until the confirmation (a migration's ALTER TABLE is not held up by
// every running handler). At the other two levels the renewal is paused, a
// renewal in flight let finish, and the claim renewed in the transaction:
// that UPDATE takes the snapshot and locks the row until the transaction
// ends, so no one else writes it before the confirmation does. A renewal
// landing after the snapshot would have made every later UPDATE of the
// row in the transaction fail with a serialization failure.
//
// A level taken from the transactions before is checked by the
// confirmation, which reads the level in the same statement: taken to be
// READ COMMITTED by mistake (a session whose default was changed), the
// transaction runs with the renewal beside it, and a renewal landing after
// its snapshot makes the confirmation fail (ConfirmTx wraps
// sqlkit.ErrGuessedLevel; the pipeline runs the transaction again with the
// level asked). The confirmation is the transaction's last statement and
// decides whether it commits, so the mistake costs a run, never a
// confirmation the claim did not earn. Taken to be a snapshot level by
// mistake, the claim is renewed in a READ COMMITTED transaction, which
// only locks its row sooner.
func holdPostgres[TTx any](ctx context.Context, st *held, s *SQLStore[TTx]) error {
	if err := checkOwned(st.claim); err != nil {
		return err
	}
	ctx, cancel := st.bounded(ctx)
	defer cancel()
	level := levelUnknown
	h := sqlkit.TxHintsFrom(ctx)
	switch {
	case h != nil && h.Level != "":
		level = levelCode(h.Level)
	case h != nil && !h.Ask:
		level = s.server.defaultLevel.Load()
		st.guessedRC = level == levelReadCommitted
	}
	if level == levelUnknown {
		var name string
		if err := s.ex.QueryRow(ctx, "SHOW transaction_isolation", nil, &name); err != nil {
			return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
		}
		level = levelCode(name)
		if h != nil && h.Level == "" {
			s.server.defaultLevel.Store(level)
		}
	}
	if level != levelSnapshot {
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
