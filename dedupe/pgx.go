package dedupe

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PgxDB is what a [PgxStore] runs its statements on. *pgxpool.Pool,
// *pgx.Conn and pgx.Tx all satisfy it.
type PgxDB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ PgxDB = (*pgxpool.Pool)(nil)
	_ PgxDB = (*pgx.Conn)(nil)
	_ PgxDB = (pgx.Tx)(nil)
)

// PgxConfig configures a [PgxStore].
type PgxConfig struct {
	// Table is the name of the claims table, a plain identifier optionally
	// qualified by a schema ("settle.dedupe"). Defaults to "settle_dedupe".
	// Its DDL is Schema(Postgres, Table): the same table a SQLStore with the
	// Postgres dialect uses, so both stores can share it.
	Table string
	// PruneBatch is how many rows one DELETE of Prune removes. Defaults to
	// 5000. Must be > 0.
	PruneBatch int
}

// Validate reports the first invalid field.
func (c PgxConfig) Validate() error {
	if err := validateTable(c.Table); err != nil {
		return fmt.Errorf("PgxConfig.Table: %w", err)
	}
	if c.PruneBatch <= 0 {
		return fmt.Errorf("PgxConfig.PruneBatch: must be > 0, got %d", c.PruneBatch)
	}
	return nil
}

// PgxStore is the Store of [SQLStore] on PostgreSQL, driven by pgx directly
// instead of through database/sql: for services whose connections are a
// *pgxpool.Pool, so that settle needs no second pool, and whose handlers
// already work in a pgx.Tx.
//
// It runs the very statements of a SQLStore with the Postgres dialect, on the
// same table, and takes every decision the same way; only the driver under
// them differs. Everything said of SQLStore holds for it: the database's
// clock for expiries, ownership decided from what a statement returned,
// transactional claims with [PgxStore.WithTx], a deadlock retried only
// outside a caller's transaction.
//
// What pgx adds: the keys of a batch that [PgxStore.ClaimConfirmedAll]'s
// statement did not take (confirmed already, or held) are read back in one
// round trip, a pgx.Batch, where database/sql spends two round trips on each.
type PgxStore struct {
	s *SQLStore
}

var _ Store = (*PgxStore)(nil)

// NewPgxStore returns a store on db. It checks cfg but touches no table.
func NewPgxStore(db PgxDB, cfg PgxConfig) (*PgxStore, error) {
	if db == nil {
		return nil, errors.New("dedupe: NewPgxStore: db is nil")
	}
	sc := SQLConfig{Dialect: Postgres, Table: cfg.Table, PruneBatch: cfg.PruneBatch}
	sc.setDefaults()
	cfg.Table, cfg.PruneBatch = sc.Table, sc.PruneBatch
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dedupe: %w", err)
	}
	return &PgxStore{s: newStore(newPgxExec(db), sc)}, nil
}

// WithTx returns a store with the same configuration that runs its
// statements on tx (or any other PgxDB, such as a *pgx.Conn). It is cheap:
// call it once per transaction. Bound to a pgx.Tx, a claim is part of that
// transaction, as for [SQLStore.WithTx].
func (p *PgxStore) WithTx(tx PgxDB) *PgxStore { return &PgxStore{s: p.s.on(newPgxExec(tx))} }

// Schema returns the DDL of this store's table; see the package-level Schema.
func (p *PgxStore) Schema() []string { return p.s.Schema() }

// Claim implements Store.
func (p *PgxStore) Claim(ctx context.Context, key string, ttl time.Duration) (Claim, error) {
	return p.s.Claim(ctx, key, ttl)
}

// Renew implements Store.
func (p *PgxStore) Renew(ctx context.Context, c Claim, ttl time.Duration) error {
	return p.s.Renew(ctx, c, ttl)
}

// Confirm implements Store.
func (p *PgxStore) Confirm(ctx context.Context, c Claim) error { return p.s.Confirm(ctx, c) }

// Release implements Store.
func (p *PgxStore) Release(ctx context.Context, c Claim) error { return p.s.Release(ctx, c) }

// Prune implements Store; see [SQLStore.Prune].
func (p *PgxStore) Prune(ctx context.Context, before time.Time) (int64, error) {
	return p.s.Prune(ctx, before)
}

// ClaimConfirmed claims key and confirms it in one statement; see
// [SQLStore.ClaimConfirmed].
func (p *PgxStore) ClaimConfirmed(ctx context.Context, key string) (Claim, error) {
	return p.s.ClaimConfirmed(ctx, key)
}

// ClaimConfirmedAll is ClaimConfirmed for many keys in one statement; see
// [SQLStore.ClaimConfirmedAll].
func (p *PgxStore) ClaimConfirmedAll(ctx context.Context, keys []string) ([]Claim, error) {
	return p.s.ClaimConfirmedAll(ctx, keys)
}

// ConfirmPgxTx is [ConfirmTx] for a handler whose transaction is a pgx.Tx.
// The middleware's store must be a *PgxStore or a *SQLStore with the Postgres
// dialect, on the database of tx.
func ConfirmPgxTx(ctx context.Context, tx pgx.Tx) error {
	return confirmIn(ctx, newPgxExec(tx))
}

// HoldPgxTx is [HoldTx] for a pgx.Tx: call it right after beginning tx,
// before any other statement in it. At REPEATABLE READ and SERIALIZABLE it
// renews the claim in tx, which locks its row until tx ends, and stops the
// background renewal, whose UPDATE beside the transaction would make the
// confirmation fail; at READ COMMITTED it changes nothing. The middleware's
// store must be a *PgxStore or a *SQLStore with the Postgres dialect.
func HoldPgxTx(ctx context.Context, tx pgx.Tx) error {
	return holdIn(ctx, newPgxExec(tx))
}

// pgxExec is the pgx executor.
type pgxExec struct {
	db PgxDB
	tx bool
}

func newPgxExec(db PgxDB) pgxExec {
	_, tx := db.(pgx.Tx)
	return pgxExec{db: db, tx: tx}
}

func (e pgxExec) exec(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := e.db.Exec(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (e pgxExec) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	err := e.db.QueryRow(ctx, query, args...).Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return errNoRows
	}
	return err
}

func (e pgxExec) query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	rows, err := e.db.Query(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

func (e pgxExec) inTx() bool { return e.tx }

// pipeliner is an executor that sends many statements in one round trip:
// pgx, with a pgx.Batch. database/sql has no way to.
type pipeliner interface {
	// queryRowEach runs query once for each element of args, all in one
	// round trip, scanning the first row of run i into dest(i). found[i]
	// reports whether run i returned a row.
	queryRowEach(ctx context.Context, query string, args [][]any, dest func(i int) []any) (found []bool, err error)
}

func (e pgxExec) queryRowEach(ctx context.Context, query string, args [][]any, dest func(i int) []any) ([]bool, error) {
	var b pgx.Batch
	for _, a := range args {
		b.Queue(query, a...)
	}
	br := e.db.SendBatch(ctx, &b)
	found := make([]bool, len(args))
	for i := range args {
		err := br.QueryRow().Scan(dest(i)...)
		switch {
		case err == nil:
			found[i] = true
		case !errors.Is(err, pgx.ErrNoRows):
			return nil, errors.Join(err, br.Close())
		}
	}
	return found, br.Close()
}

// readBackUntaken reads back the rows of the keys that ClaimConfirmedAll's
// statement did not take, all in one round trip, on an executor that can
// pipeline, and settles those it finds confirmed (Duplicate) or held (Busy).
// The others (released, expired or gone since) are left for ClaimConfirmed.
// Without it each such key costs two round trips of its own: a batch that
// is redelivered whole, after a crash between commit and ack, costs one
// statement and one round trip instead of one plus two per message.
func (s *SQLStore) readBackUntaken(ctx context.Context, claims []Claim, keys [][]byte) error {
	p, ok := s.ex.(pipeliner)
	if !ok {
		return nil
	}
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
	found, err := p.queryRowEach(ctx, s.q.readBack, args, func(j int) []any { return rows[j].columns() })
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

// Check is [SQLStore.Check] on pgx: the database answers, and the claims
// table exists with the columns of [Schema]; a missing or mis-shaped table
// is a *SchemaError naming the statements to run.
func (p *PgxStore) Check(ctx context.Context) error {
	e, ok := p.s.ex.(pgxExec)
	if !ok {
		return errors.New("dedupe: check: the store does not run on pgx")
	}
	if err := e.db.QueryRow(ctx, "SELECT 1").Scan(new(int)); err != nil {
		return fmt.Errorf("dedupe: check: the database does not answer: %w", err)
	}
	rows, err := e.db.Query(ctx, "SELECT * FROM "+p.s.dialect.quote(p.s.table)+" WHERE 1 = 0")
	if err != nil {
		return p.s.schemaErr(fmt.Sprintf("it cannot be read (%v)", err))
	}
	types := rows.Conn().TypeMap()
	have := map[string]string{}
	for _, f := range rows.FieldDescriptions() {
		name := ""
		if t, ok := types.TypeForOID(f.DataTypeOID); ok {
			name = strings.ToUpper(t.Name)
		}
		have[strings.ToLower(f.Name)] = name
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return p.s.schemaErr(fmt.Sprintf("it cannot be read (%v)", err))
	}
	return p.s.checkColumns(have)
}
