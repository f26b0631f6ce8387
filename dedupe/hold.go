package dedupe

import (
	"context"
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
// One statement asks the transaction's isolation level and, at those two
// levels only, renews the claim in the transaction: the UPDATE locks the
// row until the transaction ends, so no one else writes it before the
// confirmation does. The renewal is paused first, a renewal in flight let
// finish, because the statement takes the snapshot: a renewal that landed
// after it would make the UPDATE, and every later one in the transaction,
// fail with a serialization failure. At READ COMMITTED, where each
// statement reads the latest rows, nothing is written or locked, and the
// renewal resumes.
func holdPostgres(ctx context.Context, st *held, s *SQLStore) error {
	if err := checkOwned(st.claim); err != nil {
		return err
	}
	ctx, cancel := st.bounded(ctx)
	defer cancel()
	st.ren.pause(ctx)
	t := s.dialect.quote(s.table)
	q := `WITH lv AS (SELECT current_setting('transaction_isolation') IN ('repeatable read', 'serializable') AS snapshot),
held AS (UPDATE ` + t + ` SET expires_at = ` + s.dialect.nowMicros() + ` + $1
	WHERE key = $2 AND state = 1 AND token = $3 AND (SELECT snapshot FROM lv) RETURNING 1)
SELECT snapshot, EXISTS (SELECT 1 FROM held) FROM lv`
	var snapshot, locked bool
	err := s.ex.queryRow(ctx, q, []any{st.ttl.Microseconds(), []byte(st.claim.Key), st.claim.Token}, &snapshot, &locked)
	switch {
	case err != nil:
		st.ren.resume() // the transaction holds nothing
		return fmt.Errorf("dedupe: hold claim in transaction: %w", err)
	case !snapshot:
		st.ren.resume()
		return nil
	}
	// The transaction holds the row, or the claim is someone else's:
	// either way the background renewal has nothing left to do.
	st.stopRenew()
	if !locked {
		return fmt.Errorf("dedupe: hold claim in transaction: %w", ErrClaimLost)
	}
	return nil
}
