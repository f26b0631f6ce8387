package dedupe

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// SQLConfig configures a [SQLStore].
type SQLConfig struct {
	// Table is the name of the claims table, a plain identifier optionally
	// qualified by a schema ("settle.dedupe"). Defaults to "settle_dedupe".
	Table string
	// PruneBatch is how many rows one DELETE of Prune removes, so that pruning
	// a large table never holds long locks. Defaults to 5000. Must be > 0.
	PruneBatch int
	// Partition, when set, makes the claims table partitioned by time
	// (PostgreSQL and MySQL/MariaDB; not SQLite; on PostgreSQL read the
	// known defect in docs/dedupe.md, "The partitioned table", first), in periods of this length
	// aligned on the Unix epoch: 24h for a partition a day. Prune then drops
	// whole partitions instead of deleting rows, and creates the next ones;
	// see docs/dedupe.md for when to choose it. Prunes of one table may run
	// at the same time, from many processes. Schema returns the
	// partitioned table's statements. A claim inside a caller's transaction
	// (WithTx, ClaimConfirmed, ClaimConfirmedAll) needs READ COMMITTED on
	// PostgreSQL; any level does on MySQL/MariaDB. At least a second; zero
	// is a plain table.
	Partition time.Duration
}

func (c *SQLConfig) setDefaults() {
	if c.Table == "" {
		c.Table = "settle_dedupe"
	}
	if c.PruneBatch == 0 {
		c.PruneBatch = 5000
	}
}

func (c SQLConfig) validate() error {
	if err := sqlkit.ValidTable(c.Table); err != nil {
		return fmt.Errorf("SQLConfig.Table: %w", err)
	}
	if c.Partition != 0 && c.Partition < time.Second {
		return fmt.Errorf("SQLConfig.Partition: must be 0 or at least a second, got %v", c.Partition)
	}
	if c.PruneBatch <= 0 {
		return fmt.Errorf("SQLConfig.PruneBatch: must be > 0, got %d", c.PruneBatch)
	}
	return nil
}

// SQLStore is a Store in a SQL table, shared by every process that uses the
// same table, on any [sqldb.Driver]: database/sql on PostgreSQL,
// MySQL/MariaDB or SQLite ([sqldb.Std], TTx *sql.Tx), or pgx on PostgreSQL
// ([sqldb.Pgx], TTx pgx.Tx). The statements, and every decision taken from
// what they return, are the same whatever the driver. It never creates the
// table: run the statements of [SQLStore.Schema] with your migration tool
// first.
//
// Times are stored as Unix microseconds. On PostgreSQL and MySQL/MariaDB they
// come from the database server's clock, in the statement that writes them,
// so workers sharing a table need not agree on the time. On SQLite they come
// from the calling process, that is from the one machine the file is on.
//
// Whether a statement took a key is decided from what it wrote (the row it
// returns, on MariaDB 10.5+ too; on MySQL, which has no RETURNING, the row
// and its token read back in the claim statement's transaction, before
// anyone else can change it), never from affected-row counts, which driver
// options such as clientFoundRows change.
//
// A store bound to a transaction with [SQLStore.WithTx] makes the claim
// part of that transaction: commit it and the claim, the handler's own
// writes and the confirmation land together; roll it back and no trace of
// the claim is left. On PostgreSQL and MySQL a second transaction claiming the
// same key waits for the first to finish, then sees Duplicate (committed) or
// acquires the key (rolled back). Never renew a transactional claim: it is
// invisible to others until commit anyway.
//
// Inside a caller's transaction, at any isolation level, the store decides
// who owns a key only from what its writes saw and from locking reads, never
// from a plain read of the transaction's snapshot (which, at REPEATABLE
// READ, still shows a claim that was taken over since). A serialization
// failure or a deadlock that the database raises instead is returned,
// wrapping the driver's error: the transaction is aborted, and the caller
// must roll it back.
type SQLStore[TTx any] struct {
	db      sqldb.Driver[TTx]
	ex      sqldb.Executor
	dialect sqldb.Dialect
	// pipelined: ex sends the runs of QueryRowEach in one round trip (pgx).
	pipelined bool
	table     string
	batch     int
	q         queries
	period    int64      // µs; 0 for a plain table (SQLConfig.Partition)
	part      *partState // a partitioned table's, shared with the copies WithTx makes
	now       func() time.Time
	server    *server // shared with the copies WithTx makes
	// afterClaimWrite, set only by the tests, runs between a claim's write
	// and its read-back on a MySQL server without RETURNING.
	afterClaimWrite func()
}

// server is what a store learned of its server.
type server struct {
	// returning, for the MySQL dialect: 0 not known yet, 1 the server
	// takes INSERT … RETURNING (MariaDB 10.5 and later), 2 it does not
	// (MySQL).
	returning atomic.Int32
	// defaultLevel, on PostgreSQL: the isolation level that the last
	// confirmation in a pipeline transaction begun at the session's
	// default found (levelUnknown, levelReadCommitted, levelSnapshot), for
	// HoldTx to go by instead of asking (see holdPostgres).
	defaultLevel atomic.Int32
}

// returning reports whether claims can read the row they wrote back in the
// same statement (RETURNING): always on PostgreSQL and SQLite, on the MySQL
// dialect only with MariaDB 10.5 or later. The server's version is asked for
// once; a failure to ask is asked again at the next claim.
func (s *SQLStore[TTx]) returning(ctx context.Context) bool {
	if s.dialect != sqldb.MySQL {
		return true
	}
	switch s.server.returning.Load() {
	case 1:
		return true
	case 2:
		return false
	}
	var v string
	if err := s.queryRow(ctx, "SELECT VERSION()", nil, &v); err != nil {
		return false
	}
	ok := mariaDBReturning(v)
	if ok {
		s.server.returning.Store(1)
	} else {
		s.server.returning.Store(2)
	}
	return ok
}

// mariaDBReturning reports whether a server VERSION() names MariaDB 10.5 or
// later ("10.11.19-MariaDB-0+deb12u1", "11.4.2-MariaDB-log"), the first with
// INSERT … RETURNING.
func mariaDBReturning(version string) bool {
	if !strings.Contains(version, "MariaDB") {
		return false
	}
	major, rest, _ := strings.Cut(version, ".")
	minor, _, _ := strings.Cut(rest, ".")
	ma, err1 := strconv.Atoi(major)
	mi, err2 := strconv.Atoi(minor)
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > 10 || ma == 10 && mi >= 5
}

// NewSQLStore returns a store on db, in the dialect db.Dialect() names. It
// checks cfg but touches no table. settle does not close db.
func NewSQLStore[TTx any](db sqldb.Driver[TTx], cfg SQLConfig) (*SQLStore[TTx], error) {
	if db == nil {
		return nil, errors.New("dedupe: NewSQLStore: db is nil")
	}
	d := db.Dialect()
	if err := sqlkit.ValidDialect(d); err != nil {
		return nil, fmt.Errorf("dedupe: NewSQLStore: db.Dialect(): %w", err)
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("dedupe: %w", err)
	}
	if cfg.Partition != 0 && d == sqldb.SQLite {
		return nil, errors.New("dedupe: SQLConfig.Partition: SQLite tables are not partitioned")
	}
	q := queriesOf(d, cfg.Table)
	var part *partState
	if cfg.Partition != 0 {
		q = partitionedQueries(d, cfg.Table, q)
		part = newPartState(d, cfg.Table)
	}
	return &SQLStore[TTx]{
		db:        db,
		ex:        db.DB(),
		dialect:   d,
		pipelined: d == sqldb.Postgres && pgxTx[TTx](),
		table:     cfg.Table,
		batch:     cfg.PruneBatch,
		q:         q,
		period:    cfg.Partition.Microseconds(),
		part:      part,
		now:       time.Now,
		server:    &server{},
	}, nil
}

// pgxTx reports whether TTx is pgx's transaction (github.com/jackc/pgx/v5's
// Tx), whose driver sends the runs of Executor.QueryRowEach in one round
// trip; database/sql sends one round trip per run. The type is recognised
// by its package path, so that dedupe does not import pgx.
func pgxTx[TTx any]() bool {
	t := reflect.TypeFor[TTx]()
	return t.PkgPath() == "github.com/jackc/pgx/v5" && t.Name() == "Tx"
}

// WithTx returns a store with the same configuration that runs its
// statements in tx, a transaction of the store's driver. It is cheap: call
// it once per transaction.
func (s *SQLStore[TTx]) WithTx(tx TTx) *SQLStore[TTx] {
	c := *s
	c.ex = s.db.Tx(tx)
	return &c
}

// Schema returns the statements that create the claims table and its index,
// in the store's dialect, for your migrations. Each statement is idempotent
// (IF NOT EXISTS). It makes no connection: a tool that only prints the DDL
// can build the store on sqldb.Std(nil, dialect).
func (s *SQLStore[TTx]) Schema() []string {
	if s.period != 0 {
		return partitionedSchema(s.dialect, s.table)
	}
	return schemaOf(s.dialect, s.table)
}

// exec, queryRow and query run a statement on the store's executor. On
// MySQL the arguments are written into the statement first (inlineArgs).
func (s *SQLStore[TTx]) exec(ctx context.Context, query string, args ...any) (int64, error) {
	if s.dialect == sqldb.MySQL {
		query, args = inlineArgs(query, args)
	}
	return s.ex.Exec(ctx, query, args...)
}

func (s *SQLStore[TTx]) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	if s.dialect == sqldb.MySQL {
		query, args = inlineArgs(query, args)
	}
	return s.ex.QueryRow(ctx, query, args, dest...)
}

func (s *SQLStore[TTx]) query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	if s.dialect == sqldb.MySQL {
		query, args = inlineArgs(query, args)
	}
	return s.ex.Query(ctx, query, args, each)
}

func micros(t time.Time) int64 { return t.UnixMicro() }

// firstAt turns a stored first_at into Claim.FirstAt: zero for 0 (a row
// written before the column existed, or by ClaimConfirmed).
func firstAt(us int64) time.Time {
	if us == 0 {
		return time.Time{}
	}
	return time.UnixMicro(us)
}

// fromMicros turns a stored time back into a time.Time.
func fromMicros(us int64) time.Time { return time.UnixMicro(us) }

// claimRetries bounds how often Claim tries again when the key changed
// between its write and its read-back (released, expired or pruned in
// between). Each retry means another worker moved the key meanwhile; after
// this many the answer is Busy, which only defers the delivery.
const claimRetries = 4

// Claim implements Store.
func (s *SQLStore[TTx]) Claim(ctx context.Context, key string, ttl time.Duration) (Claim, error) {
	if err := validateKey(key); err != nil {
		return Claim{}, err
	}
	if err := checkTTL(ttl); err != nil {
		return Claim{}, err
	}
	if s.period != 0 {
		return s.claimPartitioned(ctx, key, ttl, false)
	}
	k := []byte(key)
	for range claimRetries {
		token := newToken()
		c, took, r, err := s.tryClaim(ctx, k, token, ttl)
		if err != nil && s.deadlocked(err) {
			continue // rolled back whole: nothing was written, try again
		}
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
		if took {
			c.Key, c.Result, c.Token = key, Acquired, token
			return c, nil
		}
		if !r.found {
			if r, err = s.readBack(ctx, k); err != nil {
				return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
			}
		}
		if s.dialect == sqldb.MySQL && r.found && r.state == stateClaimed && r.token == token {
			// The statement took the key: its token is ours.
			return Claim{Key: key, Result: Acquired, Token: token, Attempt: r.attempts, ExpiresAt: fromMicros(r.expires), FirstAt: firstAt(r.first)}, nil
		}
		if res, ok := r.settled(); ok {
			return Claim{Key: key, Result: res, Attempt: r.attempts}, nil
		}
		// Released, expired or gone since the write: try again.
	}
	return Claim{Key: key, Result: Busy}, nil
}

// tryClaim runs the claim statement once. took reports that it wrote the
// key for token; on MySQL it is never set: the statement's row comes back
// as it left it (r, found) instead, returned by it on MariaDB, read back
// in the same transaction on MySQL (writeReadBack), and the caller decides
// from its token.
func (s *SQLStore[TTx]) tryClaim(ctx context.Context, k []byte, token string, ttl time.Duration) (c Claim, took bool, r row, err error) {
	var attempts int
	var expires, first int64
	switch s.dialect {
	case sqldb.MySQL:
		if s.returning(ctx) {
			r, err = s.returned(ctx, s.q.claimReturning, k, token, ttl.Microseconds())
			return Claim{}, false, r, err
		}
		r, err = s.writeReadBack(ctx, k, s.q.claim, k, token, ttl.Microseconds())
		return Claim{}, false, r, err
	case sqldb.SQLite:
		now := s.now()
		exp := micros(now.Add(ttl))
		err = s.queryRow(ctx, s.q.insert, []any{k, token, exp, micros(now)}, &attempts, &first)
		if errors.Is(err, sql.ErrNoRows) {
			err = s.queryRow(ctx, s.q.takeover, []any{token, exp, micros(now), k}, &attempts, &first)
		}
		expires = exp
	default:
		if s.lease(ctx) {
			var sync string // set_config's result, the setting's new value
			err = s.queryRow(ctx, s.q.claimLease, []any{k, token, ttl.Microseconds()}, &attempts, &expires, &first, &sync)
			break
		}
		err = s.queryRow(ctx, s.q.claim, []any{k, token, ttl.Microseconds()}, &attempts, &expires, &first)
	}
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return Claim{}, false, row{}, nil
	case err != nil:
		return Claim{}, false, row{}, err
	}
	return Claim{Attempt: attempts, ExpiresAt: fromMicros(expires), FirstAt: firstAt(first)}, true, row{}, nil
}

// writeReadBack runs a claim statement (query, args) on a MySQL server
// without RETURNING and reads the row of its key k back, in one
// transaction: the row lock the write took is held until the row is read,
// so the row read is the one the write left. Run as two statements of
// their own, a claim whose lifetime ended between them could be taken over
// by another worker before its read-back, and the claim answered Busy for
// an attempt it had counted. In a caller's transaction the two run in it,
// which holds the lock as well. The row returned is always found: the
// write leaves one.
func (s *SQLStore[TTx]) writeReadBack(ctx context.Context, k []byte, query string, args ...any) (row, error) {
	if s.ex.InTx() {
		return s.writeThenRead(ctx, k, query, args)
	}
	tx, err := s.db.Begin(ctx, nil, "")
	if err != nil {
		return row{}, err
	}
	done := false
	defer func() {
		if !done {
			_ = s.db.Rollback(context.WithoutCancel(ctx), tx)
		}
	}()
	r, err := s.WithTx(tx).writeThenRead(ctx, k, query, args)
	if err != nil {
		return row{}, err
	}
	done = true
	if err := s.db.Commit(ctx, tx); err != nil {
		return row{}, err
	}
	return r, nil
}

// writeThenRead is writeReadBack's two statements, on s's executor.
func (s *SQLStore[TTx]) writeThenRead(ctx context.Context, k []byte, query string, args []any) (row, error) {
	if _, err := s.exec(ctx, query, args...); err != nil {
		return row{}, err
	}
	if s.afterClaimWrite != nil {
		s.afterClaimWrite()
	}
	r, err := s.readBack(ctx, k)
	if err == nil && !r.found {
		err = errors.New("read back: no row after the claim statement")
	}
	return r, err
}

// leaseCtxKey marks the context of a claim that the handler confirms in a
// transaction of its own on the store's database (Config.ConfirmInTx).
type leaseCtxKey struct{}

// asLease marks ctx for a lease claim (see Config.ConfirmInTx).
func asLease(ctx context.Context) context.Context {
	return context.WithValue(ctx, leaseCtxKey{}, true)
}

// lease reports whether a claim under ctx is written as a lease whose
// commit does not wait for the disk (Config.ConfirmInTx): on PostgreSQL,
// in a statement that is its own transaction. Never in a caller's
// transaction, whose commit the setting would change.
func (s *SQLStore[TTx]) lease(ctx context.Context) bool {
	return s.dialect == sqldb.Postgres && !s.ex.InTx() && ctx.Value(leaseCtxKey{}) != nil
}

// returned runs a MariaDB claim statement with RETURNING and reads the row
// it returns, which is there whatever the statement did to it.
func (s *SQLStore[TTx]) returned(ctx context.Context, query string, args ...any) (row, error) {
	var r row
	if err := s.queryRow(ctx, query, args, r.columns()...); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			err = errors.New("the claim statement returned no row")
		}
		return row{}, err
	}
	r.found = true
	return r, nil
}

// row is a key's row as read back after a write that did not take it.
type row struct {
	found    bool
	state    state
	token    string
	attempts int
	expires  int64 // µs
	first    int64 // µs, first_at
	now      int64 // µs, the clock the store compares expiries with
}

// columns are where readBack's columns (state, token, attempts, expires_at,
// first_at, now) are scanned into r.
func (r *row) columns() []any {
	return []any{&r.state, &r.token, &r.attempts, &r.expires, &r.first, &r.now}
}

// keyRow scans a row of a key followed by readBack's columns, as the
// many-key read-back and the MariaDB many-key claim return them.
func keyRow(scan func(dest ...any) error) (k []byte, r row, err error) {
	if err := scan(append([]any{&k}, r.columns()...)...); err != nil {
		return nil, row{}, err
	}
	r.found = true
	return k, r, nil
}

// settled reports the result a claim of r's key gets without writing:
// Duplicate for a confirmed key, Busy for a live claim, Refused for a
// refused key. Anything else (a released key, an expired claim, no row) can
// be taken, so ok is false.
func (r row) settled() (Result, bool) {
	switch {
	case !r.found:
		return 0, false
	case r.state == stateConfirmed:
		return Duplicate, true
	case r.state == stateRefused:
		return Refused, true
	case r.state == stateClaimed && r.expires > r.now:
		return Busy, true
	}
	return 0, false
}

func (s *SQLStore[TTx]) readBack(ctx context.Context, k []byte) (row, error) {
	var r row
	err := s.queryRow(ctx, s.q.readBack, []any{k}, r.columns()...)
	if errors.Is(err, sql.ErrNoRows) {
		return row{}, nil
	}
	if err != nil {
		return row{}, fmt.Errorf("read back: %w", err)
	}
	r.found = true
	if s.dialect == sqldb.SQLite {
		r.now = micros(s.now())
	}
	return r, nil
}

// update runs one owner-checked UPDATE and maps "no row" to ErrClaimLost.
// The WHERE clause (key, state, token) is what decides ownership: a row
// counted as found or changed was the caller's.
func (s *SQLStore[TTx]) update(ctx context.Context, op, query string, c Claim, args ...any) error {
	if err := checkOwned(c); err != nil {
		return err
	}
	k := []byte(c.Key)
	args = append(args, k, c.Token)
	n, err := s.exec(ctx, query, args...)
	if err != nil && s.ex.InTx() && sqlkit.Conflict(err) {
		return fmt.Errorf("dedupe: %s: the caller's transaction conflicts with a change of the key's row since its snapshot (a takeover or a renewal); roll it back: %w", op, err)
	}
	if err != nil {
		return fmt.Errorf("dedupe: %s: %w", op, err)
	}
	if n > 0 {
		return nil
	}
	if s.dialect == sqldb.MySQL {
		// Without clientFoundRows MySQL counts changed rows, not matched ones:
		// an UPDATE that writes the values already there reports 0. Ask
		// whether we still own it, with a locking read: in a caller's
		// transaction a plain read would answer from its snapshot, where a
		// claim taken over since is still ours. PostgreSQL and SQLite count
		// the rows the WHERE matched, and the UPDATE itself is the answer
		// (inside a caller's transaction at REPEATABLE READ or SERIALIZABLE,
		// PostgreSQL refuses an UPDATE of a row changed since the snapshot
		// with a serialization failure, which goes to the caller).
		var one int
		err := s.queryRow(ctx, s.q.owner, []any{k, c.Token}, &one)
		if err == nil {
			return nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("dedupe: %s: %w", op, err)
		}
	}
	return ErrClaimLost
}

// holds reports whether c is still the claim on its key, with a plain read
// on the store's executor (a locking one could wait for the caller's
// transaction, which may hold the row): for telling a claim that was lost
// from one that a caller's transaction could not see.
func (s *SQLStore[TTx]) holds(ctx context.Context, c Claim) bool {
	q := strings.TrimSuffix(s.q.owner, " FOR UPDATE")
	if q == "" {
		q = "SELECT 1 FROM " + sqlkit.Quote(s.dialect, s.table) + " WHERE key = $1 AND state = 1 AND token = $2"
		if s.dialect == sqldb.SQLite {
			q = strings.NewReplacer("$1", "?", "$2", "?").Replace(q)
		}
	}
	var one int
	return s.queryRow(ctx, q, []any{[]byte(c.Key), c.Token}, &one) == nil
}

// Renew implements Store.
func (s *SQLStore[TTx]) Renew(ctx context.Context, c Claim, ttl time.Duration) error {
	if err := checkTTL(ttl); err != nil {
		return err
	}
	if s.dialect == sqldb.SQLite {
		return s.update(ctx, "renew", s.q.renew, c, micros(s.now().Add(ttl)))
	}
	return s.retryPartition(ctx, ttl, func() error { return s.partUpdate(ctx, "renew", s.q.renew, c, ttl.Microseconds()) })
}

// Confirm implements Store.
func (s *SQLStore[TTx]) Confirm(ctx context.Context, c Claim) error {
	if s.dialect == sqldb.SQLite {
		return s.update(ctx, "confirm", s.q.confirm, c, micros(s.now()))
	}
	if h := sqlkit.TxHintsFrom(ctx); h != nil && s.dialect == sqldb.Postgres && s.ex.InTx() {
		return s.retryPartition(ctx, 0, func() error { return s.confirmHinted(ctx, c, h) })
	}
	return s.retryPartition(ctx, 0, func() error { return s.partUpdate(ctx, "confirm", s.q.confirm, c) })
}

// confirmHinted is Confirm in a pipeline transaction on PostgreSQL (h, its
// hints): the statement also sets the transaction's server-side limits if
// h has them still to set, before it locks the row, and reads the
// transaction's isolation level, which, for a transaction at the
// session's default, the store keeps for the next HoldTx.
func (s *SQLStore[TTx]) confirmHinted(ctx context.Context, c Claim, h *sqlkit.TxHints) error {
	if err := checkOwned(c); err != nil {
		return err
	}
	query, args := s.q.confirmLevel, []any{[]byte(c.Key), c.Token}
	limits := s.limitsToCarry(ctx) != nil
	if limits {
		query, args = s.q.confirmLimited, append(args, h.LockMillis, h.IdleMillis)
	}
	var level string
	err := s.queryRow(ctx, query, args, &level)
	switch {
	case err == nil:
		h.Carried = h.Carried || limits
		if h.Level == "" {
			s.server.defaultLevel.Store(levelCode(level))
		}
		return nil
	case errors.Is(err, sql.ErrNoRows):
		h.Carried = h.Carried || limits
		return ErrClaimLost
	case sqlkit.Conflict(err):
		return fmt.Errorf("dedupe: confirm: the caller's transaction conflicts with a change of the key's row since its snapshot (a takeover or a renewal); roll it back: %w", err)
	}
	return fmt.Errorf("dedupe: confirm: %w", err)
}

// The isolation levels a store tells apart (server.defaultLevel).
const (
	levelUnknown int32 = iota
	levelReadCommitted
	levelSnapshot // REPEATABLE READ or SERIALIZABLE: statements read the transaction's snapshot
)

// levelCode is PostgreSQL's name of an isolation level as a store tells it.
func levelCode(level string) int32 {
	if level == "repeatable read" || level == "serializable" {
		return levelSnapshot
	}
	return levelReadCommitted
}

// limitsToCarry returns the hints in ctx whose server-side limits a
// statement of s in a caller's transaction on PostgreSQL is to set, or nil.
func (s *SQLStore[TTx]) limitsToCarry(ctx context.Context) *sqlkit.TxHints {
	if s.dialect != sqldb.Postgres || !s.ex.InTx() {
		return nil
	}
	if h := sqlkit.TxHintsFrom(ctx); h != nil && h.Limits && !h.Carried {
		return h
	}
	return nil
}

// Release implements Store.
func (s *SQLStore[TTx]) Release(ctx context.Context, c Claim) error {
	if s.dialect == sqldb.SQLite {
		return s.update(ctx, "release", s.q.release, c, micros(s.now()))
	}
	return s.retryPartition(ctx, 0, func() error { return s.partUpdate(ctx, "release", s.q.release, c) })
}

// Prune implements Store. It deletes in batches of SQLConfig.PruneBatch rows
// until none is left, so it may take several statements on a large table.
// Each statement re-checks its filter on the row it deletes, under the row's
// lock, so a key claimed or confirmed while the prune runs is kept.
//
// On a partitioned table (SQLConfig.Partition) it rounds the cutoff down to
// a partition boundary (keys are kept up to one period longer), drops the
// partitions that end before it and before now whole, deletes what else
// the rounded cutoff removes in batches, and creates the partitions of the
// next periods. The number it returns adds, for each partition dropped,
// the database's estimate of its rows (from its statistics: PostgreSQL's
// reltuples, InnoDB's TABLE_ROWS), not a count, which would read a day of
// rows. Prunes of one table may run at the same time, in one process or
// many: a prune whose statement the database failed to break a deadlock
// with another runs again, after a random pause, up to ten times. Inside a
// caller's transaction it drops and creates no partition: it deletes the
// rows, as on a plain table.
func (s *SQLStore[TTx]) Prune(ctx context.Context, before time.Time) (int64, error) {
	if s.period != 0 {
		return s.prunePartitioned(ctx, before)
	}
	return s.pruneRows(ctx, before)
}

// pruneRows deletes in batches what Prune(before) deletes on a plain table.
func (s *SQLStore[TTx]) pruneRows(ctx context.Context, before time.Time) (int64, error) {
	args := append(s.pruneArgs(before), s.batch)
	var total int64
	for deadlocks := 0; ; {
		n, err := s.exec(ctx, s.q.prune, args...)
		// On a partitioned table a row the DELETE reached may have been
		// moved to another partition by a claim meanwhile (PostgreSQL's
		// 40001): the statement was rolled back whole.
		moved := err != nil && s.period != 0 && !s.ex.InTx() && movedRow(err)
		if err != nil && (s.deadlocked(err) || moved) && (deadlocks < claimRetries || s.period != 0 && deadlocks < partRetries) {
			deadlocks++
			continue
		}
		if err != nil {
			return total, fmt.Errorf("dedupe: prune: %w", err)
		}
		total += n
		if n < int64(s.batch) {
			return total, nil
		}
	}
}

// ClaimConfirmed claims key and confirms it in one statement: the fastest
// path for a store bound to a transaction (WithTx) whose commit is what makes
// the work done. Acquired means the key is now recorded as confirmed in the
// transaction, so it is final only if the transaction commits, and a rollback
// leaves no trace of it; Duplicate and Busy mean the same as for Claim. On
// PostgreSQL and MySQL a concurrent transaction claiming the same key waits
// for this one to end.
//
// The cost of the single statement: nothing durable records an attempt that
// rolled back or died with its process, so attempt counting across crashes
// must come from elsewhere (the broker's delivery count), and the claim is
// never renewed. Use Claim with ConfirmTx when you need those.
//
// Refused means a transaction refused the key (Refuse) and committed: its
// message was dead-lettered without a run, and this delivery must not run
// either.
func (s *SQLStore[TTx]) ClaimConfirmed(ctx context.Context, key string) (Claim, error) {
	if err := validateKey(key); err != nil {
		return Claim{}, err
	}
	if s.period != 0 {
		return s.claimPartitioned(ctx, key, 0, true)
	}
	k := []byte(key)
	for range claimRetries {
		token := newToken()
		took, attempts, r, err := s.tryClaimDone(ctx, k, token)
		if err != nil && s.deadlocked(err) {
			continue
		}
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim confirmed: %w", err)
		}
		if took {
			return Claim{Key: key, Result: Acquired, Attempt: attempts}, nil
		}
		if !r.found {
			if r, err = s.readBack(ctx, k); err != nil {
				return Claim{}, fmt.Errorf("dedupe: claim confirmed: %w", err)
			}
		}
		if s.dialect == sqldb.MySQL && r.found && r.state == stateConfirmed && r.token == token {
			return Claim{Key: key, Result: Acquired, Attempt: r.attempts}, nil
		}
		if res, ok := r.settled(); ok {
			return Claim{Key: key, Result: res, Attempt: r.attempts}, nil
		}
	}
	return Claim{Key: key, Result: Busy}, nil
}

// Refuse turns key, which ClaimConfirmed or ClaimConfirmedAll acquired in
// the transaction the store is bound to (WithTx), into a refused key: the
// delivery that claimed it had no attempt left (the broker's delivery count
// said so), and its message is to be dead-lettered without a run. Commit
// the transaction before the message is dead-lettered: from then on every
// claim of the key, ClaimConfirmed's, ClaimConfirmedAll's or Claim's,
// returns Refused instead of acquiring it, and so another delivery of the
// same message still in flight elsewhere (a consumer frozen or cut off
// while the broker redelivered its message) cannot run it after the
// dead-letter copy was made. Rolled back, it leaves nothing, as the claim.
//
// A refused key is pruned as a confirmed one is (Prune). It is never taken
// over: a replay of the dead-lettered message under the same key (a
// KeyFunc of the business data, say; the default key is the UUID, which a
// replay changes) is refused again, as the dedupe middleware's attempt
// count refuses it, unless the row is deleted first or the key includes the
// replay count (docs/cli.md).
//
// It returns ErrClaimLost when the transaction holds no key confirmed by
// ClaimConfirmed under that name, and an error when the store is not bound
// to a transaction.
func (s *SQLStore[TTx]) Refuse(ctx context.Context, key string) error {
	if err := validateKey(key); err != nil {
		return err
	}
	if !s.ex.InTx() {
		return errors.New("dedupe: refuse: the store is not bound to a transaction (WithTx)")
	}
	args := []any{[]byte(key)}
	if s.dialect == sqldb.SQLite {
		args = []any{micros(s.now()), []byte(key)}
	}
	// The row is the transaction's own (written by its claim, and locked
	// since): the UPDATE changes its state, so the count of changed rows
	// and the count of matched rows agree on every driver (MySQL's
	// clientFoundRows aside).
	n, err := s.exec(ctx, s.q.refuse, args...)
	if err != nil {
		return fmt.Errorf("dedupe: refuse: %w", err)
	}
	if n == 0 {
		return ErrClaimLost
	}
	return nil
}

// tryClaimDone runs the claimDone statement once; took as for tryClaim.
func (s *SQLStore[TTx]) tryClaimDone(ctx context.Context, k []byte, token string) (took bool, attempts int, r row, err error) {
	switch s.dialect {
	case sqldb.MySQL:
		if s.returning(ctx) {
			r, err = s.returned(ctx, s.q.claimDoneReturning, k, token)
			return false, 0, r, err
		}
		_, err := s.exec(ctx, s.q.claimDone, k, token)
		return false, 0, row{}, err
	case sqldb.SQLite:
		err = s.queryRow(ctx, s.q.claimDone, []any{k, token, micros(s.now())}, &attempts)
	default:
		if h := s.limitsToCarry(ctx); h != nil {
			err = s.queryRow(ctx, s.q.claimDoneLimited, []any{k, token, h.LockMillis, h.IdleMillis}, &attempts)
			h.Carried = err == nil || errors.Is(err, sql.ErrNoRows)
		} else {
			err = s.queryRow(ctx, s.q.claimDone, []any{k, token}, &attempts)
		}
	}
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, 0, row{}, nil
	case err != nil:
		return false, 0, row{}, err
	}
	return true, attempts, row{}, nil
}

// deadlocked reports an error that the database raised to break a deadlock
// (InnoDB error 1213, PostgreSQL 40P01), when the statement ran outside a
// caller's transaction. The database rolled the statement back whole, so it
// can simply run again. Claims racing a prune on MySQL meet it: the prune
// walks the updated_at index while a claim holds the row and moves its entry.
// Inside a caller's transaction the whole transaction was rolled back, and the
// error goes to the caller.
func (s *SQLStore[TTx]) deadlocked(err error) bool {
	return !s.ex.InTx() && sqlkit.Deadlock(err)
}

// readBackUntaken reads back the rows of the keys that ClaimConfirmedAll's
// statement did not take with QueryRowEach, on a driver that sends its runs
// in one round trip (pgx), and settles those it finds confirmed (Duplicate)
// or held (Busy). The others (released, expired or gone since) are left for
// ClaimConfirmed. Without a read back each such key costs two round trips
// of its own: a batch that is redelivered whole, after a crash between
// commit and ack, costs one statement and one round trip instead of one
// plus two per message.
func (s *SQLStore[TTx]) readBackUntaken(ctx context.Context, claims []Claim, keys [][]byte) error {
	var idx []int
	for i := range claims {
		if claims[i].Result == 0 {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return nil
	}
	rows := make([]row, len(idx))
	args := make([][]any, len(idx))
	for j, i := range idx {
		args[j] = []any{keys[i]}
	}
	found, err := s.ex.QueryRowEach(ctx, s.q.readBack, args, func(j int) []any { return rows[j].columns() })
	if err != nil {
		return fmt.Errorf("read back: %w", err)
	}
	for j, i := range idx {
		rows[j].found = found[j]
		if res, ok := rows[j].settled(); ok {
			claims[i].Result, claims[i].Attempt = res, rows[j].attempts
		}
	}
	return nil
}

// ClaimConfirmedAll is ClaimConfirmed for many keys in one statement (plus,
// on MySQL but not MariaDB, one read-back): the keys of a batch that commits
// together. The claims come back in the order of keys. Keys must be
// distinct.
func (s *SQLStore[TTx]) ClaimConfirmedAll(ctx context.Context, keys []string) ([]Claim, error) {
	if s.period != 0 {
		return s.claimConfirmedAllPartitioned(ctx, keys)
	}
	claims := make([]Claim, len(keys))
	if len(keys) == 0 {
		return claims, nil
	}
	bk := make([][]byte, len(keys))
	index := make(map[string]int, len(keys))
	for i, k := range keys {
		if err := validateKey(k); err != nil {
			return nil, err
		}
		if _, dup := index[k]; dup {
			return nil, fmt.Errorf("dedupe: claim confirmed: key %q given twice", k)
		}
		index[k] = i
		bk[i] = []byte(k)
		claims[i].Key = k
	}
	token := newToken()
	if s.dialect == sqldb.MySQL && s.returning(ctx) {
		// MariaDB: every key's row comes back from the one statement.
		rows, err := s.claimDoneAllReturning(ctx, bk, token)
		if err != nil {
			return nil, fmt.Errorf("dedupe: claim confirmed: %w", err)
		}
		for k, r := range rows {
			i, asked := index[k]
			if !asked {
				return nil, fmt.Errorf("dedupe: claim confirmed: a row of key %q, which was not asked for", k)
			}
			switch res, ok := r.settled(); {
			case r.state == stateConfirmed && r.token == token:
				claims[i].Result, claims[i].Attempt = Acquired, r.attempts
			case ok:
				claims[i].Result, claims[i].Attempt = res, r.attempts
			}
		}
	} else {
		taken, err := s.claimDoneAll(ctx, bk, token)
		if err != nil {
			return nil, fmt.Errorf("dedupe: claim confirmed: %w", err)
		}
		for k, attempts := range taken {
			i := index[k]
			claims[i].Result, claims[i].Attempt = Acquired, attempts
		}
		// The rest were confirmed or held already, or changed under the
		// statement. Read them all back in one round trip (pipelined on pgx,
		// one statement otherwise).
		readBack := s.readBackUntakenAll
		if s.pipelined {
			readBack = s.readBackUntaken
		}
		if err := readBack(ctx, claims, bk); err != nil {
			return nil, fmt.Errorf("dedupe: claim confirmed: %w", err)
		}
	}
	// Settle each of the others (a key whose row changed under the
	// statement) on its own.
	for i := range claims {
		if claims[i].Result != 0 {
			continue
		}
		c, err := s.ClaimConfirmed(ctx, keys[i])
		if err != nil {
			return nil, err
		}
		claims[i] = c
	}
	return claims, nil
}

// readBackUntakenAll is readBackUntaken in one statement, for a driver that
// cannot pipeline (database/sql): the rows of the keys that
// ClaimConfirmedAll's statement did not take, read as readBack reads one.
// Without it a batch that is redelivered whole (after a crash between its
// commit and its acks) costs two round trips per message.
//
// The statement that did not take them locked them (PostgreSQL's ON
// CONFLICT DO UPDATE locks the rows its WHERE turns down; MySQL reads them
// FOR UPDATE, as readBack does; SQLite has one writer), so what is read is
// what a claim would find until the transaction ends.
func (s *SQLStore[TTx]) readBackUntakenAll(ctx context.Context, claims []Claim, keys [][]byte) error {
	index := map[string]int{}
	var untaken [][]byte
	for i := range claims {
		if claims[i].Result == 0 {
			index[string(keys[i])] = i
			untaken = append(untaken, keys[i])
		}
	}
	if len(untaken) == 0 {
		return nil
	}
	t := sqlkit.Quote(s.dialect, s.table)
	var q string
	var args []any
	switch s.dialect {
	case sqldb.Postgres:
		q = `SELECT key, state, token, attempts, expires_at, first_at, ` + nowMicros(s.dialect) + ` FROM ` + t + ` WHERE key = ANY($1::bytea[])`
		args = []any{untaken}
	default:
		key, now, lock := "key", "0", ""
		if s.dialect == sqldb.MySQL {
			key, now, lock = "`key`", nowMicros(s.dialect), " FOR UPDATE"
		}
		q = `SELECT ` + key + `, state, token, attempts, expires_at, first_at, ` + now + ` FROM ` + t + ` WHERE ` + key + ` IN (?` + strings.Repeat(", ?", len(untaken)-1) + `)` + lock
		for _, k := range untaken {
			args = append(args, k)
		}
	}
	rows := map[int]row{}
	err := s.query(ctx, q, args, func(scan func(dest ...any) error) error {
		k, r, err := keyRow(scan)
		if err != nil {
			return err
		}
		i, ok := index[string(k)]
		if !ok {
			return fmt.Errorf("read back: a row of key %q, which was not asked for", k)
		}
		if s.dialect == sqldb.SQLite {
			r.now = micros(s.now())
		}
		rows[i] = r
		return nil
	})
	if err != nil {
		return fmt.Errorf("read back: %w", err)
	}
	for i, r := range rows {
		if res, ok := r.settled(); ok {
			claims[i].Result, claims[i].Attempt = res, r.attempts
		}
	}
	return nil
}

// claimDoneAll runs the many-key claimDone and returns the attempts of each
// key it wrote.
func (s *SQLStore[TTx]) claimDoneAll(ctx context.Context, keys [][]byte, token string) (map[string]int, error) {
	taken := make(map[string]int, len(keys))
	t := sqlkit.Quote(s.dialect, s.table)
	var q string
	args := make([]any, 0, 2*len(keys)+2)
	switch s.dialect {
	case sqldb.Postgres:
		q = `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
SELECT k, 2, $2, 1, 0, ` + nowMicros(s.dialect) + ` FROM unnest($1::bytea[]) AS k
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING key, attempts`
		args = append(args, keys, token)
	case sqldb.SQLite:
		now := micros(s.now())
		var b strings.Builder
		b.WriteString(`INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at) VALUES `)
		for i, k := range keys {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString("(?, 2, ?, 1, 0, ?)")
			args = append(args, k, token, now)
		}
		b.WriteString(`
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING key, attempts`)
		q = b.String()
	case sqldb.MySQL:
		return s.claimDoneAllMySQL(ctx, keys, token)
	}
	return taken, s.query(ctx, q, args, takenRow(taken))
}

// takenRow reads a (key, attempts) row into taken.
func takenRow(taken map[string]int) func(scan func(dest ...any) error) error {
	return func(scan func(dest ...any) error) error {
		var k []byte
		var attempts int
		if err := scan(&k, &attempts); err != nil {
			return err
		}
		taken[string(k)] = attempts
		return nil
	}
}

// claimDoneAllUpsert is the MySQL multi-row claimDone: every key that may
// be taken is written as confirmed with token; the others are left as they
// are (and locked).
func (s *SQLStore[TTx]) claimDoneAllUpsert(keys [][]byte, token string) (*strings.Builder, []any) {
	t := sqlkit.Quote(s.dialect, s.table)
	now := nowMicros(s.dialect)
	cond := "(state = 0 OR (state = 1 AND expires_at <= VALUES(updated_at)))"
	var b strings.Builder
	args := make([]any, 0, 2*len(keys))
	b.WriteString("INSERT INTO " + t + " (`key`, state, token, attempts, expires_at, updated_at) VALUES ")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, 2, ?, 1, 0, " + now + ")")
		args = append(args, k, token)
	}
	b.WriteString("\nON DUPLICATE KEY UPDATE attempts = IF(" + cond + ", attempts + 1, attempts),\n" +
		"\ttoken = IF(" + cond + ", VALUES(token), token),\n" +
		"\tupdated_at = IF(" + cond + ", VALUES(updated_at), updated_at),\n" +
		"\texpires_at = IF(" + cond + ", 0, expires_at),\n" +
		"\tstate = IF(" + cond + ", 2, state)")
	return &b, args
}

// claimDoneAllReturning is claimDoneAllUpsert on MariaDB, with every key's
// row returned as the statement left it.
func (s *SQLStore[TTx]) claimDoneAllReturning(ctx context.Context, keys [][]byte, token string) (map[string]row, error) {
	b, args := s.claimDoneAllUpsert(keys, token)
	b.WriteString("\nRETURNING `key`, " + mysqlReturnedRow)
	rows := make(map[string]row, len(keys))
	err := s.query(ctx, b.String(), args, func(scan func(dest ...any) error) error {
		k, r, err := keyRow(scan)
		if err != nil {
			return err
		}
		rows[string(k)] = r
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(rows) != len(keys) {
		return nil, fmt.Errorf("the claim statement returned %d rows for %d keys", len(rows), len(keys))
	}
	return rows, nil
}

// claimDoneAllMySQL writes every key it may with one multi-row upsert, then
// reads the rows back to see which carry its token.
func (s *SQLStore[TTx]) claimDoneAllMySQL(ctx context.Context, keys [][]byte, token string) (map[string]int, error) {
	t := sqlkit.Quote(s.dialect, s.table)
	b, args := s.claimDoneAllUpsert(keys, token)
	if _, err := s.exec(ctx, b.String(), args...); err != nil {
		return nil, err
	}
	b.Reset()
	b.WriteString("SELECT `key`, attempts FROM " + t + " WHERE state = 2 AND token = ? AND `key` IN (")
	args = append(args[:0], token)
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("?")
		args = append(args, k)
	}
	b.WriteString(") FOR UPDATE")
	taken := make(map[string]int, len(keys))
	return taken, s.query(ctx, b.String(), args, takenRow(taken))
}
