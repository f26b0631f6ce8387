package dedupe

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// MaxKeyLen is the longest key, in bytes, that every store accepts. Keys are
// opaque byte strings: quotes, NUL bytes, invalid UTF-8 and any other bytes
// are stored as given. The limit keeps keys inside the index-entry limits of
// PostgreSQL and MySQL/InnoDB.
const MaxKeyLen = 2048

// Result says what a call to [Store.Claim] found.
type Result int

const (
	// Acquired: the caller holds the claim, either because the key was absent
	// (or released) or because the previous holder's claim had expired.
	Acquired Result = iota + 1
	// Duplicate: the key was confirmed by an earlier delivery; the work is done.
	Duplicate
	// Busy: another worker holds an unexpired claim on the key.
	Busy
	// Refused: the key's message was dead-lettered without a run, by a
	// delivery that had no attempt left and found the key not confirmed
	// (SQLStore.Refuse); no delivery of the key is to run. Only a SQLStore
	// answers it, and only for a key some transaction refused.
	Refused
)

// String returns "acquired", "duplicate", "busy" or "refused".
func (r Result) String() string {
	switch r {
	case Acquired:
		return "acquired"
	case Duplicate:
		return "duplicate"
	case Busy:
		return "busy"
	case Refused:
		return "refused"
	default:
		return fmt.Sprintf("Result(%d)", int(r))
	}
}

// Claim is the outcome of [Store.Claim]. When Result is [Acquired] it is also
// the caller's proof of ownership: pass it to Renew, Confirm or Release.
type Claim struct {
	// Key is the claimed key.
	Key string
	// Result says whether the caller got the claim.
	Result Result
	// Token identifies this acquisition. Every acquisition gets a new one, so
	// a worker whose claim expired and was taken over cannot confirm or
	// release the new holder's claim. Empty unless Result is Acquired.
	Token string
	// Attempt counts the acquisitions of this key, this one included when
	// Result is Acquired. It survives Release and process crashes, so it
	// counts how many times the work was started.
	Attempt int
	// FirstAt is when the key was first claimed, by the store's clock: the
	// start of its first attempt. It survives Release, takeovers and
	// crashes, so it dates the first attempt even when the process that made
	// it died without a word. Zero unless Result is Acquired, and for keys
	// whose first claim was written by ClaimConfirmed or by a version of
	// the table without the first_at column.
	FirstAt time.Time
	// ExpiresAt is when the claim lapses unless renewed, by the store's clock
	// (the database server's for PostgreSQL and MySQL). Zero unless Result is
	// Acquired.
	ExpiresAt time.Time
}

// Store keeps the claim state of keys. Implementations are safe for
// concurrent use.
//
// A key moves absent -> claimed -> confirmed, or claimed -> absent again
// through Release or expiry. Confirm, Release and Renew act only on the
// caller's own claim, identified by its token; otherwise they return
// [ErrClaimLost].
type Store interface {
	// Claim tries to take the key for ttl. It returns an error only when
	// the store could not answer; Duplicate and Busy are results, not errors.
	Claim(ctx context.Context, key string, ttl time.Duration) (Claim, error)
	// Renew extends the caller's claim to ttl from now.
	Renew(ctx context.Context, c Claim, ttl time.Duration) error
	// Confirm marks the key done. Later claims of it return Duplicate.
	Confirm(ctx context.Context, c Claim) error
	// Release gives the claim up so that a retry can acquire the key at once.
	// The attempt count is kept.
	Release(ctx context.Context, c Claim) error
	// Prune deletes confirmed keys confirmed before the cutoff and released
	// or expired keys last touched before it. A live claim is never deleted,
	// nor a key confirmed or released after the cutoff, even when workers
	// claim and confirm while Prune runs: each key is judged as it is when
	// it is deleted. It returns the number of keys deleted.
	Prune(ctx context.Context, before time.Time) (int64, error)
}

var (
	// ErrClaimLost is returned by Renew, Confirm and Release when the caller
	// no longer holds the claim: it expired and was taken over, was released,
	// or the key was pruned.
	ErrClaimLost = errors.New("dedupe: claim lost")
	// ErrBusy is returned by the middleware when another worker holds a live
	// claim on the message's key. The message must be redelivered later, never
	// acked: if the holder dies, this delivery is what finishes the work.
	ErrBusy = errors.New("dedupe: key is claimed by another worker")
	// ErrEmptyKey is returned for an empty key.
	ErrEmptyKey = errors.New("dedupe: empty key")
	// ErrKeyTooLong is returned for a key longer than MaxKeyLen bytes.
	ErrKeyTooLong = fmt.Errorf("dedupe: key longer than %d bytes", MaxKeyLen)
	// ErrNotAcquired is returned when Renew, Confirm or Release is given a
	// Claim whose Result is not Acquired.
	ErrNotAcquired = errors.New("dedupe: claim was not acquired")
)

// KeyError reports a key that no store can accept. Retrying the same message
// cannot fix it, so it reports itself as permanent: the poison parking middleware sends
// such a message to the poison topic instead of retrying it.
type KeyError struct {
	Err error // ErrEmptyKey or ErrKeyTooLong
	Len int   // the key's length in bytes
}

func (e *KeyError) Error() string {
	if errors.Is(e.Err, ErrKeyTooLong) {
		return fmt.Sprintf("%v (got %d)", e.Err, e.Len)
	}
	return e.Err.Error()
}

// Unwrap returns ErrEmptyKey or ErrKeyTooLong.
func (e *KeyError) Unwrap() error { return e.Err }

// Permanent reports true: the same key will fail the same way every time.
func (e *KeyError) Permanent() bool { return true }

// validateKey returns a *KeyError if key is empty or longer than MaxKeyLen.
func validateKey(key string) error {
	switch {
	case key == "":
		return &KeyError{Err: ErrEmptyKey}
	case len(key) > MaxKeyLen:
		return &KeyError{Err: ErrKeyTooLong, Len: len(key)}
	}
	return nil
}

func checkTTL(ttl time.Duration) error {
	if ttl <= 0 {
		return fmt.Errorf("dedupe: claim ttl must be > 0, got %v", ttl)
	}
	return nil
}

func checkOwned(c Claim) error {
	if c.Result != Acquired || c.Token == "" {
		return ErrNotAcquired
	}
	return validateKey(c.Key)
}

// newToken returns 128 random bits in hex. Tokens need to be unique, not
// secret (they never leave the store), so the runtime's fast ChaCha8
// generator serves.
func newToken() string {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], rand.Uint64())
	binary.LittleEndian.PutUint64(b[8:], rand.Uint64())
	return hex.EncodeToString(b[:])
}
