package sqlkit

import (
	"context"
	"errors"
	"strconv"
)

// TxHints is what a transactional handler of settle's (pipeline) tells the
// dedupe store about the transaction its next statement runs in, carried in
// that statement's context, so that the store can do in a statement it
// sends anyway what would otherwise cost a round trip of its own.
type TxHints struct {
	// Limits, if set, are PostgreSQL's lock_timeout and
	// idle_in_transaction_session_timeout, in milliseconds, for the rest
	// of the transaction: a store that sets them in its statement
	// (set_config(…, true), evaluated before the statement locks anything)
	// sets Carried.
	Limits                 bool
	LockMillis, IdleMillis string
	Carried                bool
	// Level is the transaction's isolation level as PostgreSQL names it
	// ("read committed", "repeatable read", "serializable"), when the
	// handler set it at BEGIN and so knows it without asking; "" when the
	// transaction runs at the session's default.
	Level string
	// Ask makes the dedupe store ask the level (SHOW) rather than go by
	// the level the last transaction at the session's default found: the
	// transaction runs again after ErrGuessedLevel.
	Ask bool
}

// ErrGuessedLevel is wrapped by the error of a confirmation in a
// transaction at the session's default isolation level that the dedupe
// store took, from the transactions before it, to be READ COMMITTED, and
// that failed on a change of the claim's row since the transaction's
// snapshot: the level was REPEATABLE READ or SERIALIZABLE after all, and
// the claim's renewal beside the transaction (its own) may be the change.
// Nothing of the transaction lands (the error aborted it); run it again
// with TxHints.Ask, which holds the claim in it as that level needs.
var ErrGuessedLevel = errors.New("the transaction's isolation level was not the one its claim's hold went by")

type txHintsKey struct{}

// WithTxHints returns ctx carrying h.
func WithTxHints(ctx context.Context, h *TxHints) context.Context {
	return context.WithValue(ctx, txHintsKey{}, h)
}

// TxHintsFrom returns the hints ctx carries, or nil.
func TxHintsFrom(ctx context.Context) *TxHints {
	h, _ := ctx.Value(txHintsKey{}).(*TxHints)
	return h
}

// PostgresLimitsGate is a condition that sets TxHints' limits for the
// rest of the transaction, its parameters numbered from n (the lock
// timeout) and n+1 (the idle timeout), both text. ANDed into a
// statement's WHERE it is an uncorrelated subquery, which PostgreSQL runs
// once as an init plan under a one-time filter before the statement scans
// or locks a row (even when no row matches): the limits hold for the
// statement's own lock waits. (A WITH query the statement does not read
// would never run; the same call in RETURNING would run after the lock.)
func PostgresLimitsGate(n int) string {
	return "(SELECT set_config('lock_timeout', $" + strconv.Itoa(n) + ", true) || set_config('idle_in_transaction_session_timeout', $" + strconv.Itoa(n+1) + ", true)) IS NOT NULL"
}
