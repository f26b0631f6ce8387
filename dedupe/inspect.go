package dedupe

// API skeleton for the operator's views (settle dedupe show, the console's
// claims in flight); the bodies are filled in with the command line.

import (
	"context"
	"errors"
	"time"
)

// KeyState is what the store holds of one key of one handler scope.
type KeyState struct {
	// Scope is the handler scope (HandlerScope, or a SharedScope's name);
	// Key the key within it.
	Scope, Key string
	// State is "claimed" (a claim is or was held: see Expires),
	// "confirmed" (the work is done) or "released" (the last run failed;
	// a retry may claim it).
	State string
	// Attempts is the number of runs counted for the key.
	Attempts int
	// FirstAttempt is when the first run started (zero when unknown);
	// Updated when the row last changed (the confirmation, for a confirmed
	// key); Expires when a claim runs out (zero unless claimed).
	FirstAttempt, Updated, Expires time.Time
}

var errInspectTODO = errors.New("dedupe: not implemented yet")

// Lookup returns the state of key in scope; found is false when the store
// holds nothing of it (never claimed, or pruned).
func (s *SQLStore[TTx]) Lookup(ctx context.Context, scope, key string) (st KeyState, found bool, err error) {
	return KeyState{}, false, errInspectTODO
}

// InFlight returns up to limit keys held by a claim that has not expired,
// oldest claim first.
func (s *SQLStore[TTx]) InFlight(ctx context.Context, limit int) ([]KeyState, error) {
	return nil, errInspectTODO
}
