package dedupe

import "context"

// WithoutReturning makes s claim as it does on a MySQL server, which has no
// INSERT … RETURNING: the write, then the row read back. The tests run it on
// MariaDB, which has one, so that both paths are tried against a server.
func WithoutReturning[TTx any](s *SQLStore[TTx]) { s.server.returning.Store(2) }

// ReturningKnown reports whether s has asked its server, and its answer.
func ReturningKnown[TTx any](s *SQLStore[TTx]) (known, returning bool) {
	v := s.server.returning.Load()
	return v != 0, v == 1
}

// InlineArgs is inlineArgs, for the benchmark's floor, which sends its
// statements on MySQL as the store does.
var InlineArgs = inlineArgs

// MemoryLen is the number of keys s holds, in any state.
func MemoryLen(s *MemoryStore) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}

// PartitionBuckets lists the periods (Unix time / period) whose partitions
// s's partitioned table has.
func PartitionBuckets[TTx any](ctx context.Context, s *SQLStore[TTx]) ([]int64, error) {
	parts, err := s.partitions(ctx)
	var bs []int64
	for _, p := range parts {
		bs = append(bs, p.bucket)
	}
	return bs, err
}

// ErrTxKeyLock is the error of a partitioned MySQL store's operation in a
// caller's transaction whose key lock was not granted in time.
var ErrTxKeyLock = errTxKeyLock

// AsLease marks ctx as the middleware does with Config.ConfirmInTx.
var AsLease = asLease

// LeaseQuery is the PostgreSQL claim statement of a lease (ConfirmInTx).
func LeaseQuery[TTx any](s *SQLStore[TTx]) string { return s.q.claimLease }

// SetTxLockWait sets how long, in seconds, a partitioned MySQL store waits
// for a key's lock in a caller's transaction. Only before any test runs.
func SetTxLockWait(seconds int) { txLockWait = seconds }

// SetAfterClaimWrite makes s run f between a claim's write and its
// read-back, on a MySQL server without RETURNING (see WithoutReturning).
func SetAfterClaimWrite[TTx any](s *SQLStore[TTx], f func()) { s.afterClaimWrite = f }
