package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Dialect is the SQL dialect of a database.
type Dialect string

// The dialects settle writes its statements in.
const (
	// Postgres is PostgreSQL 13+.
	Postgres Dialect = "postgres"
	// MySQL is MySQL 8 or MariaDB 10.5+.
	MySQL Dialect = "mysql"
	// SQLite is SQLite 3.35+.
	SQLite Dialect = "sqlite"
)

// Driver is a database settle works in. TTx is the type of the
// transactions settle begins for a handler and hands to its function.
//
// An implementation must be safe for concurrent use. Statements are written
// with the dialect's placeholders ($1 on PostgreSQL, ? elsewhere).
type Driver[TTx any] interface {
	// Dialect is the database's SQL dialect.
	Dialect() Dialect
	// DB runs statements on the database's pool, each in a transaction of
	// its own.
	DB() Executor
	// Tx runs statements inside tx, a transaction the caller began (with
	// Begin or by itself): they commit or roll back with it.
	Tx(tx TTx) Executor
	// Begin begins a transaction with opts (nil for the database's
	// defaults) and then runs setup in it, when setup is not empty: one or
	// more statements separated by semicolons, such as SET LOCAL. A driver
	// that can send setup with the BEGIN, in one round trip, does so.
	Begin(ctx context.Context, opts *sql.TxOptions, setup string) (TTx, error)
	// Commit commits tx.
	Commit(ctx context.Context, tx TTx) error
	// Rollback rolls tx back. It returns nil when tx had already ended.
	Rollback(ctx context.Context, tx TTx) error
	// Listen holds one connection in PostgreSQL's LISTEN on channel (a
	// quoted identifier), calls wake once the LISTEN is in place and at
	// each notification, and returns when ctx ends or the connection
	// fails. With every > 0 and idle set, it also calls idle with an
	// Executor on that connection every that long (the first time every
	// after the LISTEN), between two waits for a notification: a periodic
	// statement run there costs one statement, where on the pool pgx's and
	// database/sql's health checks add a ping before it whenever the
	// connection they hand out has been idle for over a second. idle must
	// not keep the Executor. The connection is closed, never handed back
	// to the pool. A driver that cannot LISTEN returns an error wrapping
	// errors.ErrUnsupported at once.
	Listen(ctx context.Context, channel string, wake func(), every time.Duration, idle func(context.Context, Executor)) error
	// MaxConns is the pool's limit on open connections, 0 for none.
	MaxConns() int
}

// Executor runs statements: on the pool (Driver.DB) or in a transaction
// (Driver.Tx).
type Executor interface {
	// Exec runs a statement and returns the number of rows it affected.
	Exec(ctx context.Context, query string, args ...any) (int64, error)
	// QueryRow runs a statement and scans its first row into dest. It
	// returns sql.ErrNoRows, whatever the driver calls it, when there is
	// none.
	QueryRow(ctx context.Context, query string, args []any, dest ...any) error
	// Query runs a statement and calls each for every row, with the
	// function that scans it. An error from each ends the query and is
	// returned.
	Query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error
	// QueryRowEach runs query once for each element of args and scans the
	// first row of run i into dest(i); found[i] reports whether run i
	// returned a row. pgx sends all the runs in one round trip.
	QueryRowEach(ctx context.Context, query string, args [][]any, dest func(i int) []any) (found []bool, err error)
	// Columns runs query, which should return no row (SELECT * FROM t
	// WHERE 1 = 0), and returns its columns: the lower-case name of each
	// to the upper-case name of its type in the database ("" where the
	// driver does not say).
	Columns(ctx context.Context, query string) (map[string]string, error)
	// InTx reports whether the statements run in a caller's transaction.
	InTx() bool
	// Alive returns nil when the connection under a transaction still
	// works, and the driver's error when it does not. A transaction that a
	// failed statement aborted still has a working connection. On the pool
	// it reports whether the database answers.
	Alive(ctx context.Context) error
}

// ErrSchema is wrapped by the error of a Check (dedupe.SQLStore.Check,
// outbox.Outbox.Check) when a table settle needs is missing or does not
// have the shape it needs.
var ErrSchema = errors.New("sqldb: table missing or mis-shaped")

// SchemaError is what a Check found wrong with a table, with the
// statements that make it right.
type SchemaError struct {
	// Table is the table's name as configured.
	Table string
	// Problem says what is wrong: the table cannot be read, a column is
	// missing...
	Problem string
	// Fix says how to put it right, in words (a command to run); it may be
	// empty.
	Fix string
	// DDL are the statements that create the table, or that upgrade it,
	// as settle needs it.
	DDL []string
}

func (e *SchemaError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: table %s: %s", ErrSchema, e.Table, e.Problem)
	if e.Fix != "" {
		fmt.Fprintf(&b, "; %s", e.Fix)
	}
	if len(e.DDL) > 0 {
		fmt.Fprintf(&b, "; run in a migration:\n%s;", strings.Join(e.DDL, ";\n"))
	}
	return b.String()
}

// Unwrap returns ErrSchema.
func (e *SchemaError) Unwrap() error { return ErrSchema }

// eachRow is Executor.Query's loop, for either driver's rows: each is called
// with the scan of every row in turn; the first error it returns is the
// result, and when the rows run out, done's (which reports what the driver
// found while reading them).
func eachRow(rows interface {
	Next() bool
	Scan(dest ...any) error
}, each func(scan func(dest ...any) error) error, done func() error) error {
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return done()
}
