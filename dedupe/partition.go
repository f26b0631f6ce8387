package dedupe

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// A partitioned claims table (SQLConfig.Partition) on PostgreSQL and
// MySQL/MariaDB.
//
// Layout. Every row carries until_at, the moment after which nothing about
// the row can keep it from being pruned: its last write (updated_at) for a
// confirmed or released key, its expiry for a claim. The table is range
// partitioned on until_at in periods of SQLConfig.Partition, aligned on the
// Unix epoch; partition b holds [b·period, (b+1)·period). Every write
// (claim, renewal, confirmation, release) sets until_at again, and the
// database moves the row to the partition of its new value. So a partition
// whose end is at or before both the cutoff and now holds only rows Prune
// may delete (written before the cutoff, and claims expired before it and
// before now): Prune drops it whole, a metadata operation, without reading
// a row.
//
// Uniqueness. Neither database can keep a unique index on a partitioned
// table that lacks the partition column, so the primary key is (key,
// until_at) and the database no longer stops a second row of a key in
// another partition. Claim keeps the rule itself, in a transaction of its
// own:
//
//   - PostgreSQL, READ COMMITTED: a transaction-scoped advisory lock on a
//     64-bit hash of the table and key serializes the claims of a key (two
//     keys may share a hash; they then wait for each other, never more).
//     The next statement reads the key's row in every partition
//     (SELECT … FOR UPDATE on the parent table) with a snapshot taken after
//     the lock, so it sees the row of any claim that held the lock before;
//     the claim then inserts a row only where it found none.
//   - MySQL/MariaDB, READ COMMITTED: a named lock (GET_LOCK) on the same
//     hash serializes the claims of a key. It belongs to the connection, not
//     the transaction, so the claim releases it just before its commit; the
//     next claim's read of the key's row (SELECT … FOR UPDATE, a locking
//     read, which reads the latest row and waits for the lock of a row
//     inserted or changed and not yet committed) then waits for that commit
//     and sees the row. Relying on REPEATABLE READ's gap locks instead is
//     correct too, but every new key's insert goes into the newest,
//     nearly empty partition, where all of them fall into one gap: the
//     claims of different keys deadlocked on each other and ran one at a
//     time.
//
// Renew, Confirm and Release are single UPDATEs of the key's row (found by
// the primary key's prefix in every partition), as on a plain table.
//
// Partitions are created by the store: Prune creates the partitions of the
// next periods, and a write that finds no partition for its row (the table
// just created, Prune not run for a while, a claim whose expiry is beyond
// the partitions made) creates them and runs again.

// partRetries bounds how often a claim on a partitioned table runs again
// after its transaction was rolled back (a deadlock, a row moved to another
// partition under it) or found no partition for its row.
const partRetries = 40

// errRowChanged is a claim's takeover that found the row it had locked no
// longer there: its partition was being dropped (PostgreSQL hides a
// partition being detached from the statements that start after the
// detach began). Such a row was prunable; the claim runs again.
var errRowChanged = errors.New("the locked row left its partition")

// errPartIsolation is returned for a claim inside a caller's transaction
// on a partitioned PostgreSQL table when the transaction reads a snapshot.
var errPartIsolation = errors.New("dedupe: a partitioned claims table on PostgreSQL takes a claim inside a caller's transaction (WithTx, ClaimConfirmed, ClaimConfirmedAll) only at READ COMMITTED: " +
	"at REPEATABLE READ and SERIALIZABLE the transaction's snapshot, taken before the key's lock, cannot see the row of a claim that committed in another partition after it, and the key would be claimed twice; " +
	"claim outside the transaction (Claim, then ConfirmTx in it), or run the transaction at READ COMMITTED")

// partState is what the stores on one partitioned table (a store and the
// copies WithTx makes) share.
type partState struct {
	// horizon is the end (µs, the database's clock) of the last partition
	// the store saw: a claim inside a caller's transaction whose row ends
	// before it needs no partition made first.
	horizon atomic.Int64
	// insertDone and takeoverDone are partInsert and partTakeover for
	// ClaimConfirmed: the row written as confirmed. Args: key (insert);
	// now, key, its until_at (takeover).
	insertDone, takeoverDone string
}

func newPartState(d sqldb.Dialect, table string) *partState {
	t := sqlkit.Quote(d, table)
	now := nowMicros(d)
	p := &partState{}
	switch d {
	case sqldb.Postgres:
		p.insertDone = `INSERT INTO ` + t + ` (key, state, token, attempts, expires_at, updated_at, first_at, until_at) VALUES ($1, 2, '', 1, 0, ` + now + `, 0, ` + now + `)`
		p.takeoverDone = `UPDATE ` + t + ` SET state = 2, token = '', attempts = attempts + 1, expires_at = 0, updated_at = $1, until_at = $1 WHERE key = $2 AND until_at = $3`
	default:
		p.insertDone = "INSERT INTO " + t + " (`key`, state, token, attempts, expires_at, updated_at, first_at, until_at) VALUES (?, 2, '', 1, 0, " + now + ", 0, " + now + ")"
		p.takeoverDone = "UPDATE " + t + " SET state = 2, token = '', attempts = attempts + 1, expires_at = 0, updated_at = ?, until_at = updated_at WHERE `key` = ? AND until_at = ?"
	}
	return p
}

// partitionedSchema is schemaOf for a partitioned table.
func partitionedSchema(d sqldb.Dialect, table string) []string {
	t := sqlkit.Quote(d, table)
	idx := indexName(table)
	switch d {
	case sqldb.Postgres:
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	key        BYTEA    NOT NULL,
	state      SMALLINT NOT NULL,
	token      TEXT     NOT NULL,
	attempts   INTEGER  NOT NULL,
	expires_at BIGINT   NOT NULL,
	updated_at BIGINT   NOT NULL,
	first_at   BIGINT   NOT NULL DEFAULT 0,
	until_at   BIGINT   NOT NULL,
	PRIMARY KEY (key, until_at)
) PARTITION BY RANGE (until_at)`,
			`CREATE INDEX IF NOT EXISTS "` + idx + `" ON ` + t + ` (updated_at)`,
		}
	default:
		return []string{
			"CREATE TABLE IF NOT EXISTS " + t + ` (
	` + "`key`" + `      VARBINARY(2048) NOT NULL,
	state      TINYINT         NOT NULL,
	token      VARCHAR(32)     NOT NULL,
	attempts   INT             NOT NULL,
	expires_at BIGINT          NOT NULL,
	updated_at BIGINT          NOT NULL,
	first_at   BIGINT          NOT NULL DEFAULT 0,
	until_at   BIGINT          NOT NULL,
	PRIMARY KEY (` + "`key`" + `, until_at),
	INDEX ` + "`" + idx + "`" + ` (updated_at)
) ENGINE=InnoDB
PARTITION BY RANGE (until_at) (PARTITION p0 VALUES LESS THAN (0))`,
		}
	}
}

// partitionedQueries changes q's renewal, confirmation and release for a
// partitioned table: each sets until_at too, which moves the row to the
// partition of its new value.
func partitionedQueries(d sqldb.Dialect, table string, q queries) queries {
	t := sqlkit.Quote(d, table)
	now := nowMicros(d)
	switch d {
	case sqldb.Postgres:
		q.renew = `UPDATE ` + t + ` SET expires_at = ` + now + ` + $1, until_at = GREATEST(updated_at, ` + now + ` + $1) WHERE key = $2 AND state = 1 AND token = $3`
		q.confirm = `UPDATE ` + t + ` SET state = 2, token = '', expires_at = 0, updated_at = ` + now + `, until_at = ` + now + ` WHERE key = $1 AND state = 1 AND token = $2`
		q.release = `UPDATE ` + t + ` SET state = 0, token = '', expires_at = 0, updated_at = ` + now + `, until_at = ` + now + ` WHERE key = $1 AND state = 1 AND token = $2`
		// The pipeline's confirmations (confirmHinted) are this confirm too.
		q.confirmLevel, q.confirmLimited = confirmLevelQueries(q.confirm)
		q.refuse = `UPDATE ` + t + ` SET state = 3, token = '', expires_at = 0, updated_at = ` + now + `, until_at = ` + now + ` WHERE key = $1 AND state = 2`
		q.partProbe = `SELECT state, token, attempts, expires_at, first_at, ` + now + `, until_at FROM ` + t + ` WHERE key = $1 FOR UPDATE`
		q.partInsert = `INSERT INTO ` + t + ` (key, state, token, attempts, expires_at, updated_at, first_at, until_at) VALUES ($1, 1, $2, 1, ` +
			now + ` + $3, ` + now + `, ` + now + `, ` + now + ` + $3) RETURNING expires_at, first_at`
		q.partTakeover = `UPDATE ` + t + ` SET state = 1, token = $1, attempts = attempts + 1, expires_at = $2, updated_at = $3,
	first_at = CASE WHEN first_at = 0 THEN $3 ELSE first_at END, until_at = $2 WHERE key = $4 AND until_at = $5`
	default:
		// Assignments run left to right: until_at reads the new expires_at.
		q.renew = "UPDATE " + t + " SET expires_at = " + now + " + ?, until_at = GREATEST(updated_at, expires_at) WHERE `key` = ? AND state = 1 AND token = ?"
		q.confirm = "UPDATE " + t + " SET state = 2, token = '', expires_at = 0, updated_at = " + now + ", until_at = updated_at WHERE `key` = ? AND state = 1 AND token = ?"
		q.release = "UPDATE " + t + " SET state = 0, token = '', expires_at = 0, updated_at = " + now + ", until_at = updated_at WHERE `key` = ? AND state = 1 AND token = ?"
		q.refuse = "UPDATE " + t + " SET state = 3, token = '', expires_at = 0, updated_at = " + now + ", until_at = updated_at WHERE `key` = ? AND state = 2"
		q.partProbe = "SELECT state, token, attempts, expires_at, first_at, " + now + ", until_at FROM " + t + " WHERE `key` = ? FOR UPDATE"
		q.partInsert = "INSERT INTO " + t + " (`key`, state, token, attempts, expires_at, updated_at, first_at, until_at) VALUES (?, 1, ?, 1, " +
			now + " + ?, " + now + ", " + now + ", " + now + " + ?)"
		q.partTakeover = "UPDATE " + t + " SET state = 1, token = ?, attempts = attempts + 1, expires_at = ?, updated_at = ?,\n" +
			"\tfirst_at = IF(first_at = 0, updated_at, first_at), until_at = expires_at WHERE `key` = ? AND until_at = ?"
	}
	return q
}

// lockKey is the advisory lock of key in table (PostgreSQL).
func lockKey(table string, key []byte) int64 {
	h := fnv.New64a()
	h.Write([]byte(table))
	h.Write([]byte{0})
	h.Write(key)
	return int64(h.Sum64())
}

// claimPartitioned is Claim on a partitioned table; done claims the key
// as confirmed at once (ClaimConfirmed).
func (s *SQLStore[TTx]) claimPartitioned(ctx context.Context, key string, ttl time.Duration, done bool) (Claim, error) {
	op := "claim"
	if done {
		op = "claim confirmed"
	}
	k := []byte(key)
	if s.ex.InTx() {
		c, err := s.claimPartitionedInTx(ctx, k, ttl, done)
		if s.noPartition(err) {
			err = fmt.Errorf("no partition for the claim's row, and a claim inside a caller's transaction makes none: run Prune at least once a period (it makes the next two periods' partitions), or AddPartitions: %w", err)
		}
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: %s: %w", op, err)
		}
		c.Key = key
		return c, nil
	}
	for attempt := 0; ; attempt++ {
		c, err := s.claimPartitionedOnce(ctx, k, ttl, done)
		if err == nil {
			c.Key = key
			return c, nil
		}
		if attempt >= partRetries || ctx.Err() != nil {
			return Claim{}, fmt.Errorf("dedupe: %s: %w", op, err)
		}
		switch {
		case sqlkit.Deadlock(err) || sqlkit.Conflict(err) || movedRow(err) || errors.Is(err, errRowChanged):
			// Rolled back whole: nothing was written. Claims of a new key
			// on MySQL deadlock on each other's gap locks (see above); a
			// short random pause lets the winner commit.
			time.Sleep(time.Duration(rand.Int64N(int64(time.Millisecond) * int64(min(attempt+1, 10)))))
		case s.noPartition(err):
			if err := s.ensurePartitions(ctx, ttl); err != nil {
				return Claim{}, fmt.Errorf("dedupe: %s: %w", op, err)
			}
		default:
			return Claim{}, fmt.Errorf("dedupe: %s: %w", op, err)
		}
	}
}

// claimPartitionedOnce runs one claim transaction.
func (s *SQLStore[TTx]) claimPartitionedOnce(ctx context.Context, k []byte, ttl time.Duration, confirmed bool) (c Claim, err error) {
	tx, err := s.db.Begin(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, "")
	if err != nil {
		return Claim{}, err
	}
	done := false
	defer func() {
		if !done {
			_ = s.db.Rollback(context.WithoutCancel(ctx), tx)
		}
	}()
	st := s.WithTx(tx)
	if s.dialect == sqldb.Postgres {
		if _, err := st.exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lockKey(s.table, k)); err != nil {
			return Claim{}, err
		}
		if c, err = st.claimLocked(ctx, k, ttl, confirmed); err != nil {
			return Claim{}, err
		}
	} else {
		unlock, err := st.keyLock(ctx, k)
		if err != nil {
			return Claim{}, err
		}
		// Released before the commit: the lock is the connection's, and
		// the connection goes back to the pool with it.
		c, err = st.claimLocked(ctx, k, ttl, confirmed)
		unlock()
		if err != nil {
			return Claim{}, err
		}
	}
	done = true
	if err := s.db.Commit(ctx, tx); err != nil {
		return Claim{}, err
	}
	return c, nil
}

// claimPartitionedInTx is a claim on a partitioned table inside the
// caller's transaction, which s runs on.
//
// PostgreSQL: the transaction must be at READ COMMITTED (errPartIsolation
// otherwise), asked in the statement that takes the key's advisory lock;
// the lock is held until the caller's transaction ends, as the row lock of
// a claim on a plain table is, and the probe that follows takes a snapshot
// of its own, after the lock, so it sees the row of any claim that held
// the lock before. At REPEATABLE READ and SERIALIZABLE every statement
// reads the transaction's snapshot, which may predate the other claim's
// commit: a row it inserted in another partition would go unseen.
//
// MySQL/MariaDB, at any level: the named lock is taken and released around
// the probe and the write, and the locking read (FOR UPDATE) reads the
// latest committed row whatever the level, waiting for the row of a claim
// not committed yet, as in a claim's own transaction. At REPEATABLE READ and
// SERIALIZABLE the read also takes gap locks, so that concurrent claims of
// new keys may deadlock: the database then rolls one transaction back, and
// its caller must run it again.
//
// Nothing here creates partitions inside the caller's transaction (DDL
// there would commit it on MySQL, and wait for it on both). On PostgreSQL
// the partitions the claim's row may need are made first, on a connection
// of their own, when the last partition the store saw ends too soon and
// the caller's transaction has not used the table yet (aheadOutsideTx);
// otherwise they must have been made by Prune, which makes the next two
// periods' partitions, or by a claim outside a transaction.
func (s *SQLStore[TTx]) claimPartitionedInTx(ctx context.Context, k []byte, ttl time.Duration, confirmed bool) (Claim, error) {
	s.aheadOutsideTx(ctx, ttl)
	if s.dialect == sqldb.Postgres {
		var ok bool
		query, args := partLockQuery, []any{lockKey(s.table, k)}
		h := s.limitsToCarry(ctx)
		if h != nil {
			// A pipeline transaction's server-side limits, set before
			// the lock is waited for (sqlkit.PostgresLimitsGate).
			query, args = partLockLimitedQuery, append(args, h.LockMillis, h.IdleMillis)
		}
		err := s.queryRow(ctx, query, args, &ok)
		if err != nil {
			return Claim{}, err
		}
		if h != nil {
			h.Carried = true
		}
		if !ok {
			return Claim{}, errPartIsolation
		}
		return s.claimLocked(ctx, k, ttl, confirmed)
	}
	unlock, err := s.keyLock(ctx, k)
	if err != nil {
		return Claim{}, err
	}
	defer unlock()
	return s.claimLocked(ctx, k, ttl, confirmed)
}

// partLockQuery takes a key's advisory lock in a caller's transaction on
// PostgreSQL if the transaction is at READ COMMITTED, and says whether it
// was (claimPartitionedInTx); partLockLimitedQuery also sets a pipeline
// transaction's server-side limits first (args: the key's lock, the lock
// and idle timeouts in ms).
const partLockQuery = `SELECT CASE WHEN current_setting('transaction_isolation') IN ('read committed', 'read uncommitted')
	THEN (SELECT true FROM (SELECT pg_advisory_xact_lock($1)) l) ELSE false END`

var partLockLimitedQuery = partLockQuery + ` WHERE ` + sqlkit.PostgresLimitsGate(2)

// aheadOutsideTx makes, on PostgreSQL and on a connection of its own, the
// partitions that a claim inside a caller's transaction may write its row to, unless the last
// partition the store saw ends late enough (with half a period to spare
// for the distance between this machine's clock and the database's). It
// waits at most partAheadWait: the caller's transaction may itself hold a
// lock on the table that creating a partition waits for. Whatever it could
// not make, the claim's write reports (no partition for the row).
func (s *SQLStore[TTx]) aheadOutsideTx(ctx context.Context, ttl time.Duration) {
	if micros(time.Now())+ttl.Microseconds()+s.period/2 < s.part.horizon.Load() {
		return
	}
	if s.dialect != sqldb.Postgres {
		// MySQL/MariaDB cannot tell whether the caller's transaction holds
		// the table's metadata lock, which ADD PARTITION waits for (while
		// every statement on the table queues behind it).
		return
	}
	{
		// Creating a partition waits for every transaction that has used
		// the table: if the caller's has, it would wait for itself.
		var used bool
		err := s.queryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation' AND relation = $1::regclass)`,
			[]any{sqlkit.Quote(s.dialect, s.table)}, &used)
		if err != nil || used {
			return
		}
	}
	out := *s
	out.ex = s.db.DB()
	ctx, cancel := context.WithTimeout(ctx, partAheadWait)
	defer cancel()
	_ = out.ensurePartitions(ctx, ttl)
}

// partAheadWait bounds aheadOutsideTx.
const partAheadWait = 5 * time.Second

// claimLocked probes the key's row in every partition and writes the claim,
// with the key's lock held, in the transaction s runs on.
func (s *SQLStore[TTx]) claimLocked(ctx context.Context, k []byte, ttl time.Duration, confirmed bool) (Claim, error) {
	for range partRetries {
		c, err := s.claimLockedOnce(ctx, k, ttl, confirmed)
		if errors.Is(err, errRowChanged) {
			continue // the row's partition was being dropped: it was prunable
		}
		return c, err
	}
	return Claim{}, errRowChanged
}

func (s *SQLStore[TTx]) claimLockedOnce(ctx context.Context, k []byte, ttl time.Duration, confirmed bool) (Claim, error) {
	var r row
	var until int64
	err := s.queryRow(ctx, s.q.partProbe, []any{k}, append(r.columns(), &until)...)
	switch {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		return Claim{}, err
	default:
		r.found = true
	}
	if res, ok := r.settled(); ok {
		return Claim{Result: res, Attempt: r.attempts}, nil
	}
	if confirmed {
		if !r.found {
			if _, err := s.exec(ctx, s.part.insertDone, k); err != nil {
				return Claim{}, err
			}
			return Claim{Result: Acquired, Attempt: 1}, nil
		}
		n, err := s.exec(ctx, s.part.takeoverDone, r.now, k, until)
		if err != nil {
			return Claim{}, err
		}
		if n != 1 {
			return Claim{}, errRowChanged
		}
		return Claim{Result: Acquired, Attempt: r.attempts + 1}, nil
	}
	token := newToken()
	now, exp := r.now, r.now+ttl.Microseconds()
	if !r.found {
		// The statement reads the clock: the probe, which found no row,
		// read none. (MySQL has no RETURNING; MariaDB 10.5+ does.)
		ttlUS := ttl.Microseconds()
		switch {
		case s.dialect == sqldb.Postgres:
			err = s.queryRow(ctx, s.q.partInsert, []any{k, token, ttlUS}, &exp, &now)
		case s.returning(ctx):
			err = s.queryRow(ctx, s.q.partInsert+" RETURNING expires_at, first_at", []any{k, token, ttlUS, ttlUS}, &exp, &now)
		default:
			if _, err = s.exec(ctx, s.q.partInsert, k, token, ttlUS, ttlUS); err == nil {
				// In the claim's transaction, under the key's lock: no other
				// claim sees the row before it is read back.
				if s.afterClaimWrite != nil {
					s.afterClaimWrite()
				}
				err = s.queryRow(ctx, "SELECT expires_at, first_at FROM "+sqlkit.Quote(s.dialect, s.table)+" WHERE `key` = ? AND state = 1 AND token = ?", []any{k, token}, &exp, &now)
			}
		}
		if err != nil {
			return Claim{}, err
		}
		return Claim{Result: Acquired, Token: token, Attempt: 1, FirstAt: firstAt(now), ExpiresAt: fromMicros(exp)}, nil
	}
	n, err := s.exec(ctx, s.q.partTakeover, token, exp, now, k, until)
	if err != nil {
		return Claim{}, err
	}
	if n != 1 {
		return Claim{}, errRowChanged
	}
	first := r.first
	if first == 0 {
		first = now
	}
	return Claim{Result: Acquired, Token: token, Attempt: r.attempts + 1, FirstAt: firstAt(first), ExpiresAt: fromMicros(exp)}, nil
}

// claimConfirmedAllPartitioned is ClaimConfirmedAll on a partitioned table:
// the keys one after the other, in the order of their locks, so that two
// batches sharing keys take them in the same order and never wait for
// each other in a cycle.
func (s *SQLStore[TTx]) claimConfirmedAllPartitioned(ctx context.Context, keys []string) ([]Claim, error) {
	claims := make([]Claim, len(keys))
	order := make([]int, len(keys))
	seen := make(map[string]bool, len(keys))
	for i, k := range keys {
		if err := validateKey(k); err != nil {
			return nil, err
		}
		if seen[k] {
			return nil, fmt.Errorf("dedupe: claim confirmed: key %q given twice", k)
		}
		seen[k] = true
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Compare(uint64(lockKey(s.table, []byte(keys[a]))), uint64(lockKey(s.table, []byte(keys[b]))))
	})
	for _, i := range order {
		c, err := s.claimPartitioned(ctx, keys[i], 0, true)
		if err != nil {
			return nil, err
		}
		claims[i] = c
	}
	return claims, nil
}

// mysqlLockWait is how long, in seconds, a claim on a partitioned MySQL
// table waits for the key's named lock.
const mysqlLockWait = 30

// movedRow reports PostgreSQL's refusal to lock or update a row that a
// concurrent statement moved to another partition (a serialization
// failure, 40001, which Conflict reports too).
func movedRow(err error) bool { return sqlkit.SQLState(err) == "40001" }

// noPartition reports a write that found no partition for its row:
// PostgreSQL's check violation 23514 ("no partition of relation … found for
// row"), MySQL's error 1526.
func (s *SQLStore[TTx]) noPartition(err error) bool {
	if n, ok := sqlkit.MySQLNumber(err); ok {
		return n == 1526
	}
	return sqlkit.SQLState(err) == "23514"
}

// partition is one partition of the table: rows with until_at below upper.
type partition struct {
	name    string // quoted, ready for a statement (PostgreSQL: the table; MySQL: the partition)
	bucket  int64  // upper / period - 1; -1 for MySQL's first, empty, partition
	upper   int64  // µs
	pending bool   // PostgreSQL: a detach that did not finish
	// rows is the database's estimate of the partition's rows, from its
	// statistics (PostgreSQL's reltuples, InnoDB's TABLE_ROWS); -1 when
	// the partition was never analyzed (PostgreSQL).
	rows int64
}

var pgBound = regexp.MustCompile(`FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)`)

// partitions lists the table's partitions, in the order of their ends.
func (s *SQLStore[TTx]) partitions(ctx context.Context) ([]partition, error) {
	var parts []partition
	switch s.dialect {
	case sqldb.Postgres:
		// pg_get_expr is given no relation (0): a bound names no column.
		// Given one, it takes the partition's lock for a moment, to read
		// the names of its columns: the listing waited there for another
		// prune's detach, which was waiting for the listing's transaction
		// to end (a deadlock); and it returned NULL for a partition that
		// another prune dropped after the statement read the catalog.
		err := s.query(ctx, `SELECT n.nspname, c.relname, pg_get_expr(c.relpartbound, 0), i.inhdetachpending, c.reltuples::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.inhparent = $1::regclass`, []any{sqlkit.Quote(s.dialect, s.table)}, func(scan func(dest ...any) error) error {
			var nsp, name, bound string
			var pending bool
			var rows int64
			if err := scan(&nsp, &name, &bound, &pending, &rows); err != nil {
				return err
			}
			m := pgBound.FindStringSubmatch(bound)
			if m == nil {
				return fmt.Errorf("partition %s: bound %q is not a range of until_at", name, bound)
			}
			upper, _ := strconv.ParseInt(m[2], 10, 64)
			parts = append(parts, partition{name: sqlkit.Quote(s.dialect, nsp) + "." + sqlkit.Quote(s.dialect, name),
				bucket: upper/s.period - 1, upper: upper, pending: pending, rows: rows})
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("list partitions: %w", err)
		}
	default:
		schema, name := "", s.table
		if i := strings.LastIndexByte(s.table, '.'); i >= 0 {
			schema, name = s.table[:i], s.table[i+1:]
		}
		err := s.query(ctx, `SELECT partition_name, partition_description, COALESCE(table_rows, 0) FROM information_schema.PARTITIONS
WHERE table_schema = COALESCE(NULLIF(?, ''), DATABASE()) AND table_name = ? AND partition_name IS NOT NULL`, []any{schema, name}, func(scan func(dest ...any) error) error {
			var pname, desc string
			var rows int64
			if err := scan(&pname, &desc, &rows); err != nil {
				return err
			}
			upper, err := strconv.ParseInt(desc, 10, 64)
			if err != nil {
				return fmt.Errorf("partition %s: bound %q is not a number", pname, desc)
			}
			parts = append(parts, partition{name: "`" + pname + "`", bucket: upper/s.period - 1, upper: upper, rows: rows})
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("list partitions: %w", err)
		}
	}
	slices.SortFunc(parts, func(a, b partition) int { return int(min(max(a.upper-b.upper, -1), 1)) })
	return parts, nil
}

// dbNow is the database's clock, in µs.
func (s *SQLStore[TTx]) dbNow(ctx context.Context) (int64, error) {
	var now int64
	err := s.queryRow(ctx, "SELECT "+nowMicros(s.dialect), nil, &now)
	return now, err
}

// ensurePartitions creates the partitions from the current period to the
// one holding now + ahead + one period, those that do not exist yet.
func (s *SQLStore[TTx]) ensurePartitions(ctx context.Context, ahead time.Duration) error {
	now, err := s.dbNow(ctx)
	if err != nil {
		return fmt.Errorf("partitions: %w", err)
	}
	return s.addPartitions(ctx, now, now+ahead.Microseconds()+s.period)
}

// addPartitions creates the partitions of the periods holding from..to
// that do not exist. On MySQL partitions can only be added after the last
// one, so there the periods before the last partition's end are covered by
// it already.
func (s *SQLStore[TTx]) addPartitions(ctx context.Context, from, to int64) error {
	parts, err := s.partitions(ctx)
	if err != nil {
		return err
	}
	have := map[int64]bool{}
	var last int64 = -1 << 62
	for _, p := range parts {
		have[p.bucket] = true
		last = max(last, p.upper)
	}
	s.seePartitions(last)
	t := sqlkit.Quote(s.dialect, s.table)
	var add []string
	for b := floorDiv(from, s.period); b <= floorDiv(to, s.period); b++ {
		lo, hi := b*s.period, (b+1)*s.period
		switch s.dialect {
		case sqldb.Postgres:
			if have[b] {
				continue
			}
			name := sqlkit.Quote(s.dialect, pgPartName(s.table, b))
			_, err := s.exec(ctx, `CREATE TABLE IF NOT EXISTS `+name+` PARTITION OF `+t+
				` FOR VALUES FROM (`+strconv.FormatInt(lo, 10)+`) TO (`+strconv.FormatInt(hi, 10)+`)`)
			// Another process may have made it, or one that overlaps it,
			// meanwhile (duplicate table, invalid definition).
			if err != nil && !slices.Contains([]string{"42P07", "42P17", "23505"}, sqlkit.SQLState(err)) {
				return fmt.Errorf("create partition %s: %w", name, err)
			}
		default:
			if hi <= last {
				continue
			}
			add = append(add, "PARTITION p"+strconv.FormatInt(b, 10)+" VALUES LESS THAN ("+strconv.FormatInt(hi, 10)+")")
		}
	}
	covered := (floorDiv(to, s.period) + 1) * s.period
	if len(add) == 0 {
		s.seePartitions(covered)
		return nil
	}
	// On MariaDB the ALTER waits at most a few seconds for the transactions
	// that use the table (a caller's transaction holding a claim may be
	// one): waiting, it would hold up every statement on the table queued
	// behind it.
	bounded := ""
	if s.returning(ctx) {
		bounded = "SET STATEMENT lock_wait_timeout = " + strconv.Itoa(int(partAheadWait/time.Second)) + " FOR "
	}
	_, err = s.exec(ctx, bounded+"ALTER TABLE "+t+" ADD PARTITION ("+strings.Join(add, ", ")+")")
	if n, ok := sqlkit.MySQLNumber(err); ok && (n == 1517 || n == 1493) {
		// Added by another process meanwhile (duplicate partition name,
		// bounds no longer increasing): look again.
		return s.addPartitions(ctx, from, to)
	}
	if err != nil {
		return fmt.Errorf("add partitions: %w", err)
	}
	s.seePartitions(covered)
	return nil
}

// seePartitions records that the table has partitions up to end (µs).
func (s *SQLStore[TTx]) seePartitions(end int64) {
	for {
		h := s.part.horizon.Load()
		if end <= h || s.part.horizon.CompareAndSwap(h, end) {
			return
		}
	}
}

// pgPartName is the name of the table's partition b: the table's name
// followed by _p and b, within 62 bytes: PostgreSQL's names are 63, and
// the array type it makes for the partition's row type is named "_" and the
// name cut to 63, so two partitions whose names differ only in their 63rd
// byte could not both be made. A name that would be
// longer keeps a prefix and a hash of the whole name, so that two tables
// whose names begin alike do not name their partitions alike.
func pgPartName(table string, b int64) string {
	suffix := "_p" + strconv.FormatInt(b, 10)
	schema, name := "", table
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		schema, name = table[:i+1], table[i+1:]
	}
	const maxName = 62
	if len(name)+len(suffix) > maxName {
		h := fnv.New32a()
		h.Write([]byte(name))
		tag := fmt.Sprintf("_%08x", h.Sum32())
		name = name[:maxName-len(suffix)-len(tag)] + tag
	}
	return schema + name + suffix
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// AddPartitions creates, on a partitioned claims table (SQLConfig.Partition),
// the partitions of the periods from from to to that do not exist yet. The
// store creates the partitions it writes to by itself (Prune creates the
// next ones ahead of time); this is for loading keys older than the table,
// as when moving the keys of a plain table into a partitioned one. On
// MySQL/MariaDB partitions are only added after the last one, whose range
// reaches back to the first partition's end. It returns an error on a plain
// table.
func (s *SQLStore[TTx]) AddPartitions(ctx context.Context, from, to time.Time) error {
	if s.period == 0 {
		return errors.New("dedupe: AddPartitions: the claims table is not partitioned (SQLConfig.Partition)")
	}
	if err := s.addPartitions(ctx, micros(from), micros(to)); err != nil {
		return fmt.Errorf("dedupe: %w", err)
	}
	return nil
}

// prunePartitioned is Prune on a partitioned table. The cutoff is rounded
// down to a partition boundary, so that a prune never deletes rows one by
// one inside a partition that a later prune will drop whole: keys are kept
// up to one period longer than the cutoff asks. Then it drops the
// partitions that end at or before both the rounded cutoff and now, deletes
// in batches what else the rounded cutoff removes (claims that expired
// before it but were written to a later partition, rows of partitions that
// are not over yet when the cutoff is in the future), and creates the
// partitions of the next periods.
//
// Prunes of one table may run at the same time (every process of a service
// pruning on its own schedule): each drops what is left to drop. Their
// statements lock the table and its partitions in different orders (a
// detach or a drop locks the partition it removes and, on PostgreSQL,
// waits for the transactions using the table; a new partition locks the
// table), and the database may break a deadlock between them by failing
// one statement (PostgreSQL's 40P01, InnoDB's 1213), which changed
// nothing: the prune runs again, after a random pause, up to pruneRetries
// times, and what it dropped before the deadlock counts in the number it
// returns.
func (s *SQLStore[TTx]) prunePartitioned(ctx context.Context, before time.Time) (int64, error) {
	cut := floorDiv(micros(before), s.period) * s.period
	if s.ex.InTx() {
		// Inside a caller's transaction: no DDL (MySQL would commit the
		// transaction; PostgreSQL detaches concurrently only outside one),
		// the rows are deleted as on a plain table.
		return s.pruneRows(ctx, time.UnixMicro(cut))
	}
	var total int64
	for attempt := 1; ; attempt++ {
		n, err := s.prunePartitionsOnce(ctx, cut)
		total += n
		if err == nil || !sqlkit.Deadlock(err) || attempt >= pruneRetries {
			return total, err
		}
		if err := pausePrune(ctx, attempt); err != nil {
			return total, fmt.Errorf("dedupe: prune: %w", err)
		}
	}
}

// pruneRetries bounds how often a prune of a partitioned table runs again
// after a deadlock with another prune (prunePartitioned).
const pruneRetries = 10

// pausePrune waits before a prune's next attempt: a random while of up to
// 100 ms times the attempts so far, at most a second, so that prunes that
// deadlocked do not meet again in step. It returns ctx's error if ctx ends
// first.
func pausePrune(ctx context.Context, attempt int) error {
	t := time.NewTimer(time.Duration(rand.Int64N(int64(min(attempt, 10)) * int64(100*time.Millisecond))))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// prunePartitionsOnce is one attempt of prunePartitioned, outside a
// caller's transaction, with the cutoff rounded (cut, µs).
func (s *SQLStore[TTx]) prunePartitionsOnce(ctx context.Context, cut int64) (int64, error) {
	// Two periods ahead: claims inside callers' transactions, which make no
	// partition, find theirs made as long as a prune runs once a period.
	if err := s.ensurePartitions(ctx, time.Duration(s.period)*time.Microsecond); err != nil {
		return 0, fmt.Errorf("dedupe: prune: %w", err)
	}
	now, err := s.dbNow(ctx)
	if err != nil {
		return 0, fmt.Errorf("dedupe: prune: %w", err)
	}
	parts, err := s.partitions(ctx)
	if err != nil {
		return 0, fmt.Errorf("dedupe: prune: %w", err)
	}
	var total int64
	for i, p := range parts {
		if p.upper > cut || p.upper > now || i == len(parts)-1 {
			continue
		}
		n, err := s.dropPartition(ctx, p)
		total += n
		if err != nil {
			return total, fmt.Errorf("dedupe: prune: %w", err)
		}
	}
	n, err := s.pruneRows(ctx, time.UnixMicro(cut))
	return total + n, err
}

// dropPartition removes p whole and returns how many rows it held, as the
// database estimates them (partition.rows). A partition that another prune
// is dropping at the same time is left to it.
func (s *SQLStore[TTx]) dropPartition(ctx context.Context, p partition) (int64, error) {
	n, err := s.dropPartitionOnce(ctx, p)
	if err == nil {
		return n, nil
	}
	if sqlkit.SQLState(err) == "55000" {
		// PostgreSQL detaches one partition of a table at a time: another
		// prune is detaching one. This one is left to a later prune.
		return 0, nil
	}
	parts, lerr := s.partitions(ctx)
	if lerr != nil {
		return 0, err
	}
	for _, q := range parts {
		if q.name == p.name && !q.pending {
			return 0, err
		}
	}
	return 0, nil // gone, or being detached by another prune
}

// dropPartitionOnce drops p. The rows it returns are the database's
// estimate from its statistics, not a count: a count reads the whole
// partition, a day's rows, which took seconds of the prune's time on
// MariaDB (where it ran before the drop, whose metadata lock waited for it)
// and grows with the day on both. Only a PostgreSQL partition that was
// never analyzed, which autovacuum does to any partition of some size, is
// counted (after its detach, holding no lock a claim needs).
func (s *SQLStore[TTx]) dropPartitionOnce(ctx context.Context, p partition) (int64, error) {
	t := sqlkit.Quote(s.dialect, s.table)
	n := max(p.rows, 0)
	switch s.dialect {
	case sqldb.Postgres:
		// Detached concurrently, the partition leaves the parent without
		// the lock on the parent that DROP TABLE of a partition takes, which
		// would stop every claim until the transactions in flight end.
		detach := ` CONCURRENTLY`
		if p.pending {
			detach = ` FINALIZE`
		}
		if _, err := s.exec(ctx, `ALTER TABLE `+t+` DETACH PARTITION `+p.name+detach); err != nil {
			return 0, fmt.Errorf("detach partition %s: %w", p.name, err)
		}
		if p.rows < 0 {
			if err := s.queryRow(ctx, `SELECT count(*) FROM `+p.name, nil, &n); err != nil {
				return 0, fmt.Errorf("count partition %s: %w", p.name, err)
			}
		}
		// Detached, the table is no longer a partition, and no later prune
		// would find it: a deadlock does not leave it there.
		for attempt := 1; ; attempt++ {
			_, err := s.exec(ctx, `DROP TABLE `+p.name)
			if err == nil {
				break
			}
			if !sqlkit.Deadlock(err) || attempt >= pruneRetries {
				return 0, fmt.Errorf("drop partition %s: %w", p.name, err)
			}
			if err := pausePrune(ctx, attempt); err != nil {
				return 0, fmt.Errorf("drop partition %s: %w", p.name, err)
			}
		}
	default:
		if _, err := s.exec(ctx, "ALTER TABLE "+t+" DROP PARTITION "+p.name); err != nil {
			return 0, fmt.Errorf("drop partition %s: %w", p.name, err)
		}
	}
	return n, nil
}

// partUpdate is update for Renew, Confirm and Release. On a partitioned
// MySQL table it holds the key's named lock while the UPDATE runs: the
// UPDATE moves the row to another partition (its until_at changes), and
// InnoDB's locking read, which a claim probes with, walks the partitions one
// after the other; a probe that read the row's new partition before the
// row arrived there and then waited for its old place, which the move
// deletes, would find no row at all. With the lock a claim probes after the
// row has moved, and waits on the moved row's lock for its commit.
// PostgreSQL instead refuses to lock a row that moved under the probe (a
// serialization failure), and the claim runs again.
func (s *SQLStore[TTx]) partUpdate(ctx context.Context, op, query string, c Claim, args ...any) error {
	if s.period == 0 || s.dialect != sqldb.MySQL {
		return s.update(ctx, op, query, c, args...)
	}
	if err := checkOwned(c); err != nil {
		return err
	}
	if s.ex.InTx() {
		// The caller's transaction: the lock is released after the
		// statement, the moved row stays locked until the commit.
		unlock, err := s.keyLock(ctx, []byte(c.Key))
		if err != nil {
			return fmt.Errorf("dedupe: %s: %w", op, err)
		}
		defer unlock()
		return s.update(ctx, op, query, c, args...)
	}
	tx, err := s.db.Begin(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, "")
	if err != nil {
		return fmt.Errorf("dedupe: %s: %w", op, err)
	}
	st := s.WithTx(tx)
	unlock, err := st.keyLock(ctx, []byte(c.Key))
	if err != nil {
		_ = s.db.Rollback(context.WithoutCancel(ctx), tx)
		return fmt.Errorf("dedupe: %s: %w", op, err)
	}
	err = st.update(ctx, op, query, c, args...)
	unlock()
	if err != nil && !errors.Is(err, ErrClaimLost) {
		_ = s.db.Rollback(context.WithoutCancel(ctx), tx)
		return err
	}
	if cerr := s.db.Commit(ctx, tx); cerr != nil {
		return fmt.Errorf("dedupe: %s: %w", op, cerr)
	}
	return err
}

// keyLock takes the named lock of key (MySQL) on the store's executor and
// returns its release. In a transaction of the store's own it waits up to
// mysqlLockWait; in a caller's transaction only up to mysqlTxLockWait, and
// then fails with errTxKeyLock: the caller's transaction may hold the lock
// of a row of the key (its earlier claim, or a read at SERIALIZABLE) that
// the holder of the named lock waits for, a cycle through two kinds of
// lock that neither InnoDB nor the named locks see.
func (s *SQLStore[TTx]) keyLock(ctx context.Context, k []byte) (unlock func(), err error) {
	name := fmt.Sprintf("settle-dedupe-%016x", uint64(lockKey(s.table, k)))
	wait := mysqlLockWait
	if s.ex.InTx() {
		wait = txLockWait
	}
	var got sql.NullInt64
	if err := s.queryRow(ctx, "SELECT GET_LOCK(?, ?)", []any{name, wait}, &got); err != nil {
		return nil, err
	}
	if got.Int64 != 1 {
		if s.ex.InTx() {
			return nil, errTxKeyLock
		}
		return nil, fmt.Errorf("the lock of the key was not granted within %d s", wait)
	}
	return func() { _, _ = s.exec(context.WithoutCancel(ctx), "DO RELEASE_LOCK(?)", name) }, nil
}

// mysqlTxLockWait is keyLock's wait, in seconds, in a caller's transaction.
const mysqlTxLockWait = 5

// txLockWait is mysqlTxLockWait, shortened by the package's tests before
// any runs (a cycle at SERIALIZABLE, where reads lock rows, otherwise costs
// the linearizability run minutes of waits).
var txLockWait = mysqlTxLockWait

// errTxKeyLock is keyLock's failure in a caller's transaction.
var errTxKeyLock = fmt.Errorf("the key's lock was not granted within %d s: another claim of the key may be waiting for a lock this transaction holds; roll the transaction back and run it again", mysqlTxLockWait)

// retryPartition runs write, and again once after creating the partitions
// it found missing, outside a caller's transaction.
// On a partitioned MySQL table an UPDATE that moves a row to another
// partition can deadlock with a claim's gap locks; the statement was rolled
// back whole and runs again.
func (s *SQLStore[TTx]) retryPartition(ctx context.Context, ahead time.Duration, write func() error) error {
	for attempt := 0; ; attempt++ {
		err := write()
		if err == nil || s.period == 0 || s.ex.InTx() || attempt >= partRetries || ctx.Err() != nil {
			return err
		}
		switch {
		case sqlkit.Deadlock(err) || movedRow(err):
			// Rolled back whole. PostgreSQL refuses to update a row that a
			// concurrent claim moved to another partition (its takeover of
			// an expired claim); run again, the UPDATE finds the row there.
			time.Sleep(time.Duration(rand.Int64N(int64(time.Millisecond) * int64(min(attempt+1, 10)))))
		case s.noPartition(err):
			if err := s.ensurePartitions(ctx, ahead); err != nil {
				return err
			}
		default:
			return err
		}
	}
}
