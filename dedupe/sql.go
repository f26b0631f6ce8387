package dedupe

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// DB is what a [SQLStore] runs its statements on. *sql.DB, *sql.Tx and
// *sql.Conn all satisfy it.
type DB interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

var (
	_ DB = (*sql.DB)(nil)
	_ DB = (*sql.Tx)(nil)
	_ DB = (*sql.Conn)(nil)
)

// SQLConfig configures a [SQLStore].
type SQLConfig struct {
	// Dialect is the SQL flavour of the database. Required.
	Dialect Dialect
	// Table is the name of the claims table, a plain identifier optionally
	// qualified by a schema ("settle.dedupe"). Defaults to "settle_dedupe".
	Table string
	// PruneBatch is how many rows one DELETE of Prune removes, so that pruning
	// a large table never holds long locks. Defaults to 5000. Must be > 0.
	PruneBatch int
}

// DefaultTable is the table name used when SQLConfig.Table is empty.
const DefaultTable = "settle_dedupe"

func (c *SQLConfig) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.PruneBatch == 0 {
		c.PruneBatch = 5000
	}
}

// Validate reports the first invalid field.
func (c SQLConfig) Validate() error {
	if err := c.Dialect.valid(); err != nil {
		return fmt.Errorf("SQLConfig.Dialect: %w", err)
	}
	if err := validateTable(c.Table); err != nil {
		return fmt.Errorf("SQLConfig.Table: %w", err)
	}
	if c.PruneBatch <= 0 {
		return fmt.Errorf("SQLConfig.PruneBatch: must be > 0, got %d", c.PruneBatch)
	}
	return nil
}

// SQLStore is a Store in a SQL table, shared by every process that uses the
// same table. It never creates the table: run the statements of [Schema] with
// your migration tool first.
//
// Times are written from the worker's clock as Unix microseconds, so the
// clocks of workers sharing a table must agree to well within the claim
// timeout (NTP does this).
//
// A SQLStore built on a *sql.Tx (directly or with [SQLStore.WithTx]) makes
// the claim part of that transaction: commit it and the claim, the handler's
// own writes and the confirmation land together; roll it back and no trace of
// the claim is left. On PostgreSQL and MySQL a second transaction claiming the
// same key waits for the first to finish, then sees Duplicate (committed) or
// acquires the key (rolled back). Never renew a transactional claim: it is
// invisible to others until commit anyway.
type SQLStore struct {
	db      DB
	dialect Dialect
	table   string
	batch   int
	q       queries
	now     func() time.Time
}

// NewSQLStore returns a store on db. It checks cfg but touches no table.
func NewSQLStore(db DB, cfg SQLConfig) (*SQLStore, error) {
	if db == nil {
		return nil, errors.New("dedupe: NewSQLStore: db is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dedupe: %w", err)
	}
	return &SQLStore{
		db:      db,
		dialect: cfg.Dialect,
		table:   cfg.Table,
		batch:   cfg.PruneBatch,
		q:       cfg.Dialect.queries(cfg.Table),
		now:     time.Now,
	}, nil
}

// WithTx returns a store with the same configuration that runs its
// statements on tx (or any other DB, such as a *sql.Conn). It is cheap: call
// it once per transaction.
func (s *SQLStore) WithTx(tx DB) *SQLStore {
	c := *s
	c.db = tx
	return &c
}

// Schema returns the statements that create the claims table and its index,
// for your migrations. Each statement is idempotent (IF NOT EXISTS).
func Schema(d Dialect, table string) ([]string, error) {
	if table == "" {
		table = DefaultTable
	}
	if err := d.valid(); err != nil {
		return nil, err
	}
	if err := validateTable(table); err != nil {
		return nil, err
	}
	return d.schema(table), nil
}

// Schema returns the DDL of this store's table; see the package-level Schema.
func (s *SQLStore) Schema() []string { return s.dialect.schema(s.table) }

func micros(t time.Time) int64 { return t.UnixMicro() }

// Claim implements Store.
func (s *SQLStore) Claim(ctx context.Context, key string, ttl time.Duration) (Claim, error) {
	if err := ValidateKey(key); err != nil {
		return Claim{}, err
	}
	if err := checkTTL(ttl); err != nil {
		return Claim{}, err
	}
	now := s.now()
	token := newToken()
	expires := now.Add(ttl)
	k := []byte(key)
	acquired := Claim{Key: key, Result: Acquired, Token: token, ExpiresAt: expires}

	if s.dialect == MySQL {
		res, err := s.db.ExecContext(ctx, s.q.claim, k, token, micros(expires), micros(now))
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
		switch n {
		case 1: // inserted
			acquired.Attempt = 1
			return acquired, nil
		case 2: // took over a released or expired claim
			st, attempts, err := s.lookup(ctx, k)
			if err != nil {
				return Claim{}, err
			}
			if st != stateClaimed {
				return Claim{}, fmt.Errorf("dedupe: claim: row of taken-over key is in state %d", st)
			}
			acquired.Attempt = attempts
			return acquired, nil
		}
	} else if s.dialect == SQLite {
		res, err := s.db.ExecContext(ctx, s.q.insert, k, token, micros(expires), micros(now))
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
		if n == 1 {
			acquired.Attempt = 1
			return acquired, nil
		}
		var attempts int
		err = s.db.QueryRowContext(ctx, s.q.takeover, token, micros(expires), micros(now), k).Scan(&attempts)
		if err == nil {
			acquired.Attempt = attempts
			return acquired, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
	} else {
		var attempts int
		err := s.db.QueryRowContext(ctx, s.q.claim, k, token, micros(expires), micros(now)).Scan(&attempts)
		if err == nil {
			acquired.Attempt = attempts
			return acquired, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return Claim{}, fmt.Errorf("dedupe: claim: %w", err)
		}
	}

	return s.notTaken(ctx, key, k)
}

// notTaken reads why an existing key could not be taken: Duplicate
// (confirmed) or Busy (held).
func (s *SQLStore) notTaken(ctx context.Context, key string, k []byte) (Claim, error) {
	st, attempts, err := s.lookup(ctx, k)
	if err != nil {
		return Claim{}, err
	}
	c := Claim{Key: key, Attempt: attempts, Result: Busy}
	if st == stateConfirmed {
		c.Result = Duplicate
	}
	return c, nil
}

func (s *SQLStore) lookup(ctx context.Context, key []byte) (state, int, error) {
	var st state
	var attempts int
	err := s.db.QueryRowContext(ctx, s.q.lookup, key).Scan(&st, &attempts)
	if errors.Is(err, sql.ErrNoRows) {
		// Released and pruned between our insert attempt and this read; the
		// caller may simply try again.
		return stateClaimed, 0, nil
	}
	if err != nil {
		return 0, 0, fmt.Errorf("dedupe: claim lookup: %w", err)
	}
	return st, attempts, nil
}

// update runs one owner-checked UPDATE and maps "no row" to ErrClaimLost.
func (s *SQLStore) update(ctx context.Context, op, query string, c Claim, first any) error {
	if err := checkOwned(c); err != nil {
		return err
	}
	k := []byte(c.Key)
	res, err := s.db.ExecContext(ctx, query, first, k, c.Token)
	if err != nil {
		return fmt.Errorf("dedupe: %s: %w", op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("dedupe: %s: %w", op, err)
	}
	if n > 0 {
		return nil
	}
	if s.dialect == MySQL {
		// MySQL counts changed rows, not matched ones: an UPDATE that writes
		// the values already there reports 0. Ask whether we still own it.
		var one int
		err := s.db.QueryRowContext(ctx, s.q.owner, k, c.Token).Scan(&one)
		if err == nil {
			return nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("dedupe: %s: %w", op, err)
		}
	}
	return ErrClaimLost
}

// Renew implements Store.
func (s *SQLStore) Renew(ctx context.Context, c Claim, ttl time.Duration) error {
	if err := checkTTL(ttl); err != nil {
		return err
	}
	return s.update(ctx, "renew", s.q.renew, c, micros(s.now().Add(ttl)))
}

// Confirm implements Store.
func (s *SQLStore) Confirm(ctx context.Context, c Claim) error {
	return s.update(ctx, "confirm", s.q.confirm, c, micros(s.now()))
}

// Release implements Store.
func (s *SQLStore) Release(ctx context.Context, c Claim) error {
	return s.update(ctx, "release", s.q.release, c, micros(s.now()))
}

// Prune implements Store. It deletes in batches of SQLConfig.PruneBatch rows
// until none is left, so it may take several statements on a large table.
func (s *SQLStore) Prune(ctx context.Context, before time.Time) (int64, error) {
	cutoff := micros(before)
	// A claim that has not expired yet is live whatever the cutoff says.
	expired := min(cutoff, micros(s.now()))
	var total int64
	for {
		res, err := s.db.ExecContext(ctx, s.q.prune, cutoff, expired, s.batch)
		if err != nil {
			return total, fmt.Errorf("dedupe: prune: %w", err)
		}
		n, err := res.RowsAffected()
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
func (s *SQLStore) ClaimConfirmed(ctx context.Context, key string) (Claim, error) {
	if err := ValidateKey(key); err != nil {
		return Claim{}, err
	}
	k := []byte(key)
	res, err := s.db.ExecContext(ctx, s.q.claimDone, k, micros(s.now()))
	if err != nil {
		return Claim{}, fmt.Errorf("dedupe: claim confirmed: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return Claim{}, fmt.Errorf("dedupe: claim confirmed: %w", err)
	}
	if n > 0 {
		return Claim{Key: key, Result: Acquired}, nil
	}
	return s.notTaken(ctx, key, k)
}
