package dedupe

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"strconv"
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

// sqlExec is the database/sql executor. With inline (MySQL) it writes the
// arguments into the statement (see inlineArgs).
type sqlExec struct {
	db     DB
	inline bool
}

func (e sqlExec) exec(ctx context.Context, query string, args ...any) (int64, error) {
	if e.inline {
		query, args = inlineArgs(query, args)
	}
	res, err := e.db.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (e sqlExec) queryRow(ctx context.Context, query string, args []any, dest ...any) error {
	if e.inline {
		query, args = inlineArgs(query, args)
	}
	err := e.db.QueryRowContext(ctx, query, args...).Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return errNoRows
	}
	return err
}

func (e sqlExec) query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error {
	if e.inline {
		query, args = inlineArgs(query, args)
	}
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

// inlineArgs writes args into a MySQL statement as literals, so that the
// statement goes to the server as one text query. go-sql-driver/mysql sends
// a statement that has arguments as a prepare and an execute (two round
// trips) and a close unless the DSN says interpolateParams=true, which it
// does not by default; a claim then cost twice the round trips it needs. The
// arguments of the store's statements are keys ([]byte, written as hex
// literals, so no byte of a key can end the literal), tokens (hex strings)
// and integers. A statement with any other argument, or a string with
// another character, is left as it was, with its placeholders.
func inlineArgs(query string, args []any) (string, []any) {
	if len(args) == 0 {
		return query, args
	}
	size := len(query)
	for _, a := range args {
		switch a := a.(type) {
		case []byte:
			size += 2*len(a) + 3
		case string:
			for i := 0; i < len(a); i++ {
				if !plainByte(a[i]) {
					return query, args
				}
			}
			size += len(a) + 2
		case int, int64:
			size += 20
		default:
			return query, args
		}
	}
	b := make([]byte, 0, size)
	n := 0
	for i := 0; i < len(query); i++ {
		if query[i] != '?' {
			b = append(b, query[i])
			continue
		}
		if n == len(args) {
			return query, args // more placeholders than arguments: the driver says so
		}
		switch a := args[n].(type) {
		case []byte:
			b = append(b, "X'"...)
			b = hex.AppendEncode(b, a)
			b = append(b, '\'')
		case string:
			b = append(b, '\'')
			b = append(b, a...)
			b = append(b, '\'')
		case int:
			b = strconv.AppendInt(b, int64(a), 10)
		case int64:
			b = strconv.AppendInt(b, a, 10)
		}
		n++
	}
	if n != len(args) {
		return query, args
	}
	return string(b), nil
}

// plainByte reports whether c may stand in a quoted MySQL string literal
// as itself whatever the server's SQL mode.
func plainByte(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c == '-'
}
