package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Std is the Driver of a database/sql pool whose database speaks dialect d:
// PostgreSQL through pgx's stdlib driver, MySQL or MariaDB through
// go-sql-driver/mysql, SQLite through modernc.org/sqlite. The handlers'
// transactions are *sql.Tx. settle does not close db.
//
// On PostgreSQL the outbox's relay LISTENs only when db's driver is pgx's
// (it reaches the *pgx.Conn under a database/sql connection); with another
// driver it polls.
func Std(db *sql.DB, d Dialect) Driver[*sql.Tx] {
	return stdDriver{db: db, dialect: d}
}

type stdDriver struct {
	db      *sql.DB
	dialect Dialect
}

func (d stdDriver) Dialect() Dialect       { return d.dialect }
func (d stdDriver) DB() Executor           { return stdExec{q: d.db} }
func (d stdDriver) Tx(tx *sql.Tx) Executor { return stdExec{q: tx, tx: true} }
func (d stdDriver) MaxConns() int          { return d.db.Stats().MaxOpenConnections }

func (d stdDriver) Begin(ctx context.Context, opts *sql.TxOptions, setup string) (*sql.Tx, error) {
	tx, err := d.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	if setup != "" {
		if _, err := tx.ExecContext(ctx, setup); err != nil {
			return nil, errors.Join(err, rollbackStd(tx))
		}
	}
	return tx, nil
}

func (d stdDriver) Commit(_ context.Context, tx *sql.Tx) error { return tx.Commit() }

func (d stdDriver) Rollback(_ context.Context, tx *sql.Tx) error { return rollbackStd(tx) }

func rollbackStd(tx *sql.Tx) error {
	if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return nil
}

// errNoListen: the connection under database/sql is not pgx's.
var errNoListen = fmt.Errorf("sqldb: the database/sql driver is not pgx (github.com/jackc/pgx/v5/stdlib), which alone can LISTEN: %w", errors.ErrUnsupported)

func (d stdDriver) Listen(ctx context.Context, channel string, wake func()) error {
	if d.dialect != Postgres {
		return fmt.Errorf("sqldb: LISTEN is PostgreSQL's: %w", errors.ErrUnsupported)
	}
	c, err := d.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Raw(func(dc any) error {
		pc, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return errNoListen
		}
		// driver.ErrBadConn: the connection is LISTENing (or broken),
		// database/sql must not hand it back to the pool.
		return errors.Join(listenOn(ctx, pc.Conn(), channel, wake), driver.ErrBadConn)
	})
}

// listenOn runs LISTEN on c and waits for notifications until ctx ends or
// c fails.
func listenOn(ctx context.Context, c *pgx.Conn, channel string, wake func()) error {
	if _, err := c.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	wake()
	for {
		if _, err := c.WaitForNotification(ctx); err != nil {
			return err
		}
		wake()
	}
}

// stdQuerier is what *sql.DB, *sql.Conn and *sql.Tx have in common.
type stdQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

type stdExec struct {
	q  stdQuerier
	tx bool
}

func (e stdExec) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := e.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (e stdExec) QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	return e.q.QueryRowContext(ctx, query, args...).Scan(dest...)
}

func (e stdExec) Query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	rows, err := e.q.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return eachRow(rows, each, func() error {
		if err := rows.Err(); err != nil {
			return err
		}
		return rows.Close()
	})
}

func (e stdExec) QueryRowEach(ctx context.Context, query string, args [][]any, dest func(i int) []any) ([]bool, error) {
	found := make([]bool, len(args))
	for i, a := range args {
		err := e.QueryRow(ctx, query, a, dest(i)...)
		switch {
		case err == nil:
			found[i] = true
		case !errors.Is(err, sql.ErrNoRows):
			return nil, err
		}
	}
	return found, nil
}

func (e stdExec) Columns(ctx context.Context, query string) (map[string]string, error) {
	rows, err := e.q.QueryContext(ctx, query)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	types, err := rows.ColumnTypes()
	if err != nil {
		return nil, err
	}
	have := make(map[string]string, len(types))
	for _, t := range types {
		have[strings.ToLower(t.Name())] = strings.ToUpper(t.DatabaseTypeName())
	}
	for rows.Next() {
	}
	return have, rows.Err()
}

func (e stdExec) InTx() bool { return e.tx }

func (e stdExec) Alive(ctx context.Context) error {
	_, err := e.q.ExecContext(ctx, "SELECT 1")
	return err
}
