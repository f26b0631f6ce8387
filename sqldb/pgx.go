package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Pgx is the Driver of a pgx v5 pool on PostgreSQL: settle needs no
// database/sql pool beside it, and the handlers' transactions are pgx.Tx.
// The outbox's relay LISTENs on one connection of pool for as long as it
// runs (closed, not returned, when it stops), so the pool must allow at
// least two (with one the relay polls). settle does not close pool. Pgx(nil)
// names the dialect only: its statements fail.
func Pgx(pool *pgxpool.Pool) Driver[pgx.Tx] { return pgxDriver{pool: pool} }

type pgxDriver struct{ pool *pgxpool.Pool }

func (d pgxDriver) Dialect() Dialect { return Postgres }
func (d pgxDriver) DB() Executor {
	if d.pool == nil {
		return failExec{errNilPool}
	}
	return pgxExec{q: d.pool}
}
func (d pgxDriver) Tx(tx pgx.Tx) Executor { return pgxExec{q: tx, tx: tx} }
func (d pgxDriver) MaxConns() int {
	if d.pool == nil {
		return 0
	}
	return int(d.pool.Stat().MaxConns())
}

// Begin maps opts onto pgx's: the isolation level (sql.LevelDefault is
// the server's default) and read-only. setup rides in the BEGIN's round
// trip: pgx sends a BeginQuery without arguments as one simple query.
func (d pgxDriver) Begin(ctx context.Context, opts *sql.TxOptions, setup string) (pgx.Tx, error) {
	if d.pool == nil {
		return nil, errNilPool
	}
	var po pgx.TxOptions
	if opts != nil {
		switch opts.Isolation {
		case sql.LevelDefault:
		case sql.LevelReadUncommitted:
			po.IsoLevel = pgx.ReadUncommitted
		case sql.LevelReadCommitted:
			po.IsoLevel = pgx.ReadCommitted
		case sql.LevelRepeatableRead, sql.LevelSnapshot:
			po.IsoLevel = pgx.RepeatableRead
		case sql.LevelSerializable, sql.LevelLinearizable:
			po.IsoLevel = pgx.Serializable
		default:
			return nil, errors.New("sqldb: isolation level " + opts.Isolation.String() + " is not PostgreSQL's")
		}
		if opts.ReadOnly {
			po.AccessMode = pgx.ReadOnly
		}
	}
	if setup != "" {
		begin := "begin"
		if po.IsoLevel != "" {
			begin += " isolation level " + string(po.IsoLevel)
		}
		if po.AccessMode != "" {
			begin += " " + string(po.AccessMode)
		}
		po.BeginQuery = begin + "; " + setup
	}
	return d.pool.BeginTx(ctx, po)
}

func (d pgxDriver) Commit(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }

func (d pgxDriver) Rollback(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

func (d pgxDriver) Listen(ctx context.Context, channel string, wake func(), every time.Duration, idle func(context.Context, Executor)) error {
	if d.pool == nil {
		return errNilPool
	}
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() {
		// LISTENing (or broken): take it out of the pool and close it.
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = c.Hijack().Close(cctx)
	}()
	return listenOn(ctx, c.Conn(), channel, wake, every, idle)
}

// pgxQuerier is what *pgxpool.Pool and pgx.Tx have in common.
type pgxQuerier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

type pgxExec struct {
	q  pgxQuerier
	tx pgx.Tx // nil on the pool
}

func (e pgxExec) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := e.q.Exec(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (e pgxExec) QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	err := e.q.QueryRow(ctx, query, args...).Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return sql.ErrNoRows
	}
	return err
}

func (e pgxExec) Query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	rows, err := e.q.Query(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return eachRow(rows, each, func() error {
		rows.Close() // pgx's Err is final once the rows are closed
		return rows.Err()
	})
}

func (e pgxExec) QueryRowEach(ctx context.Context, query string, args [][]any, dest func(i int) []any) ([]bool, error) {
	var b pgx.Batch
	for _, a := range args {
		b.Queue(query, a...)
	}
	br := e.q.SendBatch(ctx, &b)
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

func (e pgxExec) Columns(ctx context.Context, query string) (map[string]string, error) {
	rows, err := e.q.Query(ctx, query)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	types := rows.Conn().TypeMap()
	have := map[string]string{}
	for _, f := range rows.FieldDescriptions() {
		name := ""
		if t, ok := types.TypeForOID(f.DataTypeOID); ok {
			name = strings.ToUpper(t.Name)
		}
		have[strings.ToLower(f.Name)] = name
	}
	for rows.Next() {
	}
	rows.Close()
	return have, rows.Err()
}

func (e pgxExec) InTx() bool { return e.tx != nil }

// Alive asks pgx, which closes a connection on any failure of its I/O or a
// FATAL error from the server, without a round trip; on the pool it pings.
func (e pgxExec) Alive(ctx context.Context) error {
	if e.tx == nil {
		_, err := e.q.Exec(ctx, "SELECT 1")
		return err
	}
	if e.tx.Conn().IsClosed() {
		return pgconn.ErrConnClosed
	}
	return nil
}
