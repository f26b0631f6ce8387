package dedupe

import (
	"context"
	"database/sql"
	"errors"
)

// executor runs a store's statements on one database driver. The statements
// themselves, and every decision taken from what they return, are written
// once (dialect.go, sql.go); an executor only sends them and reads the rows,
// the way River's riverdriver puts database/sql and pgx under one interface.
type executor interface {
	// exec runs a statement and returns the rows it affected.
	exec(ctx context.Context, query string, args ...any) (int64, error)
	// queryRow runs a statement and scans its first row into dest. It
	// returns errNoRows, whatever the driver calls it, when there is none.
	queryRow(ctx context.Context, query string, args []any, dest ...any) error
	// query runs a statement and calls each for every row, with the function
	// that scans it.
	query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error
	// inTx reports that the statements run in a caller's transaction: an
	// error that rolled the transaction back must go to the caller, not be
	// retried.
	inTx() bool
}

// errNoRows is what executors return for sql.ErrNoRows and pgx.ErrNoRows.
var errNoRows = errors.New("dedupe: no rows")

// sqlExec is the database/sql executor.
type sqlExec struct{ db DB }

func (e sqlExec) exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := e.db.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (e sqlExec) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	err := e.db.QueryRowContext(ctx, query, args...).Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return errNoRows
	}
	return err
}

func (e sqlExec) query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	rows, err := e.db.QueryContext(ctx, query, args...)
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

func (e sqlExec) inTx() bool {
	_, ok := e.db.(*sql.Tx)
	return ok
}
