package dedupe

import (
	"context"
	"sync"
	"time"
)

// MemoryStore is a Store held in the process's memory. It is per-process:
// claims are not shared with other processes and are lost when the process
// exits. Use it for tests and for single-process pipelines on a broker that
// does not redeliver across restarts; use [SQLStore] everywhere else.
//
// The zero value is not usable; call [NewMemoryStore].
type MemoryStore struct {
	mu   sync.Mutex
	keys map[string]*memEntry
	now  func() time.Time
}

type memEntry struct {
	state     state
	token     string
	attempts  int
	expiresAt time.Time
	updatedAt time.Time
	firstAt   time.Time
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]*memEntry), now: time.Now}
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, key string, ttl time.Duration) (Claim, error) {
	if err := validateKey(key); err != nil {
		return Claim{}, err
	}
	if err := checkTTL(ttl); err != nil {
		return Claim{}, err
	}
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.keys[key]
	if !ok {
		e = &memEntry{}
		s.keys[key] = e
	}
	switch {
	case e.state == stateConfirmed:
		return Claim{Key: key, Result: Duplicate, Attempt: e.attempts}, nil
	case e.state == stateClaimed && e.expiresAt.After(now):
		return Claim{Key: key, Result: Busy, Attempt: e.attempts}, nil
	}
	e.state = stateClaimed
	e.token = newToken()
	e.attempts++
	if e.firstAt.IsZero() {
		e.firstAt = now
	}
	e.expiresAt = now.Add(ttl)
	e.updatedAt = now
	return Claim{Key: key, Result: Acquired, Token: e.token, Attempt: e.attempts, ExpiresAt: e.expiresAt, FirstAt: e.firstAt}, nil
}

// owned returns the entry of c if c still holds it. The caller holds s.mu.
func (s *MemoryStore) owned(c Claim) (*memEntry, error) {
	if err := checkOwned(c); err != nil {
		return nil, err
	}
	e, ok := s.keys[c.Key]
	if !ok || e.state != stateClaimed || e.token != c.Token {
		return nil, ErrClaimLost
	}
	return e, nil
}

// Renew implements Store.
func (s *MemoryStore) Renew(ctx context.Context, c Claim, ttl time.Duration) error {
	if err := checkTTL(ttl); err != nil {
		return err
	}
	return s.update(ctx, c, func(e *memEntry, now time.Time) { e.expiresAt = now.Add(ttl) })
}

// Confirm implements Store.
func (s *MemoryStore) Confirm(ctx context.Context, c Claim) error {
	return s.end(ctx, c, stateConfirmed)
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, c Claim) error {
	return s.end(ctx, c, stateReleased)
}

// end moves the caller's claim to a confirmed or released state.
func (s *MemoryStore) end(ctx context.Context, c Claim, to state) error {
	return s.update(ctx, c, func(e *memEntry, now time.Time) {
		e.state, e.token, e.expiresAt, e.updatedAt = to, "", time.Time{}, now
	})
}

// update applies f, under s.mu, to the entry c still holds, with the time
// read before the lock was taken; ErrClaimLost (through owned) when c no
// longer holds it.
func (s *MemoryStore) update(ctx context.Context, c Claim, f func(e *memEntry, now time.Time)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e, err := s.owned(c)
	if err != nil {
		return err
	}
	f(e, now)
	return nil
}

// Prune implements Store.
func (s *MemoryStore) Prune(ctx context.Context, before time.Time) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	expired := before
	if now := s.now(); now.Before(expired) {
		expired = now // a claim that has not expired yet is live whatever the cutoff says
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for k, e := range s.keys {
		if e.updatedAt.Before(before) && (e.state != stateClaimed || e.expiresAt.Before(expired)) {
			delete(s.keys, k)
			n++
		}
	}
	return n, nil
}

// inProcess marks the store as one whose calls never wait on I/O: the
// middleware settles claims without a timeout context of its own.
func (*MemoryStore) inProcess() {}
