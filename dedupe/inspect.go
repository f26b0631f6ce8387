package dedupe

// The operator's views of a claims table: one key's state (settle dedupe
// show, the console's key lookup) and the claims held now (settle dedupe
// inflight, the console's claims in flight). The table stores keys as bytes
// with their scope (ScopedKey) and times as Unix microseconds, which psql
// cannot answer "was order 17 charged, when?" from; these read them back.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// KeyState is what the store holds of one key of one handler scope.
type KeyState struct {
	// Scope is the handler scope (HandlerScope, or a SharedScope's name);
	// Key the key within it.
	Scope, Key string
	// State is "claimed" (a claim is or was held: see Expires),
	// "confirmed" (the work is done), "released" (the last run failed;
	// a retry may claim it) or "refused" (dead-lettered without a run by a
	// delivery with no attempt left; every later delivery is refused too,
	// see SQLStore.Refuse).
	State string
	// Attempts is the number of runs counted for the key.
	Attempts int
	// FirstAttempt is when the first run started (zero when unknown);
	// Updated when the row last changed (the confirmation, for a confirmed
	// key); Expires when a claim runs out (zero unless claimed).
	FirstAttempt, Updated, Expires time.Time
}

// The values of KeyState.State.
const (
	keyClaimed   = "claimed"
	keyConfirmed = "confirmed"
	keyReleased  = "released"
	keyRefused   = "refused"
)

func (st state) String() string {
	switch st {
	case stateClaimed:
		return keyClaimed
	case stateConfirmed:
		return keyConfirmed
	case stateReleased:
		return keyReleased
	case stateRefused:
		return keyRefused
	}
	return "state " + strconv.Itoa(int(st))
}

// inspectColumns are the columns Lookup and InFlight read, after the key.
const inspectColumns = "state, attempts, expires_at, updated_at, first_at"

// Lookup returns the state of key in scope; found is false when the store
// holds nothing of it (never claimed, or pruned). It is a plain read: inside
// a transaction (WithTx) it answers from the transaction's snapshot.
func (s *SQLStore[TTx]) Lookup(ctx context.Context, scope, key string) (st KeyState, found bool, err error) {
	stored := ScopedKey(scope, key)
	if err := validateKey(stored); err != nil {
		return KeyState{}, false, err
	}
	t := sqlkit.Quote(s.dialect, s.table)
	q := "SELECT " + inspectColumns + " FROM " + t + " WHERE " + s.keyColumn() + " = " + s.param(1)
	var (
		sv                      state
		attempts                int
		expires, updated, first int64
	)
	err = s.queryRow(ctx, q, []any{[]byte(stored)}, &sv, &attempts, &expires, &updated, &first)
	if errors.Is(err, sql.ErrNoRows) {
		return KeyState{}, false, nil
	}
	if err != nil {
		return KeyState{}, false, fmt.Errorf("dedupe: lookup: %w", err)
	}
	return keyState(scope, key, sv, attempts, expires, updated, first), true, nil
}

// InFlight returns up to limit keys held by a claim that has not expired,
// oldest claim first. A claim's age is that of its last takeover (Updated);
// expiry is judged by the database's clock (on SQLite, this process's). The
// claims table has no index on state: InFlight reads the whole table, which
// is meant for an operator's view, not a hot path. limit must be > 0.
func (s *SQLStore[TTx]) InFlight(ctx context.Context, limit int) ([]KeyState, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("dedupe: in flight: limit must be > 0, got %d", limit)
	}
	t := sqlkit.Quote(s.dialect, s.table)
	now := nowMicros(s.dialect)
	args := []any{limit}
	if s.dialect == sqldb.SQLite {
		now = "?2"
		args = append(args, micros(s.now()))
	}
	q := "SELECT " + s.keyColumn() + ", " + inspectColumns + " FROM " + t +
		" WHERE state = 1 AND expires_at > " + now +
		" ORDER BY updated_at, " + s.keyColumn() + " LIMIT " + s.param(1)
	var out []KeyState
	err := s.query(ctx, q, args, func(scan func(dest ...any) error) error {
		var (
			k                       []byte
			sv                      state
			attempts                int
			expires, updated, first int64
		)
		if err := scan(&k, &sv, &attempts, &expires, &updated, &first); err != nil {
			return err
		}
		scope, key := splitScopedKey(string(k))
		out = append(out, keyState(scope, key, sv, attempts, expires, updated, first))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dedupe: in flight: %w", err)
	}
	return out, nil
}

// keyColumn is the key column, quoted where the dialect reserves the word.
func (s *SQLStore[TTx]) keyColumn() string {
	if s.dialect == sqldb.MySQL {
		return "`key`"
	}
	return "key"
}

// param is the dialect's n-th placeholder.
func (s *SQLStore[TTx]) param(n int) string {
	switch s.dialect {
	case sqldb.Postgres:
		return "$" + strconv.Itoa(n)
	case sqldb.SQLite:
		return "?" + strconv.Itoa(n)
	}
	return "?"
}

func keyState(scope, key string, sv state, attempts int, expires, updated, first int64) KeyState {
	st := KeyState{Scope: scope, Key: key, State: sv.String(), Attempts: attempts,
		FirstAttempt: firstAt(first), Updated: fromMicros(updated)}
	if sv == stateClaimed && expires != 0 {
		st.Expires = fromMicros(expires)
	}
	return st
}

// splitScopedKey is the inverse of ScopedKey: the scope and the key a stored
// key was made of. A stored key that ScopedKey cannot have made (a
// NUL-prefixed key whose length prefix is malformed) is returned whole as
// the key, in no scope.
func splitScopedKey(stored string) (scope, key string) {
	if !strings.HasPrefix(stored, "\x00") {
		scope, key, ok := strings.Cut(stored, "\x00")
		if !ok {
			return "", stored
		}
		return scope, key
	}
	n, rest, ok := strings.Cut(stored[1:], ":")
	l, err := strconv.Atoi(n)
	if !ok || err != nil || l < 0 || l > len(rest) || strconv.Itoa(l) != n {
		return "", stored
	}
	return rest[:l], rest[l:]
}
