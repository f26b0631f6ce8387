package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Std is the Driver of a database/sql pool whose database speaks dialect d:
// PostgreSQL through pgx's stdlib driver, MySQL or MariaDB through
// go-sql-driver/mysql, SQLite through modernc.org/sqlite. The handlers'
// transactions are *sql.Tx. settle does not close db. Std(nil, d) names a
// dialect only (for a tool that prints DDL): its statements fail, as do
// those of a db whose driver settle knows as another dialect's.
//
// On PostgreSQL the outbox's relay LISTENs only when db's driver is pgx's
// (it reaches the *pgx.Conn under a database/sql connection); with another
// driver it polls.
func Std(db *sql.DB, d Dialect) Driver[*sql.Tx] {
	drv := stdDriver{db: db, dialect: d}
	if db == nil {
		drv.err = errNilPool
	} else if pkg, got := driverDialect(db); got != "" && got != d {
		drv.err = fmt.Errorf("sqldb: Std(db, %q): db's driver (%s) is %s's: pass sqldb.%s", string(d), pkg, got, dialectName[got])
	}
	return drv
}

type stdDriver struct {
	db      *sql.DB
	dialect Dialect
	err     error // every statement's: a nil pool, or the wrong dialect
}

// driverPkgs are the database/sql drivers whose dialect Std knows, by
// package path (so that sqldb imports none of them).
var driverPkgs = map[string]Dialect{
	"github.com/jackc/pgx/v5/stdlib": Postgres,
	"github.com/lib/pq":              Postgres,
	"github.com/go-sql-driver/mysql": MySQL,
	"modernc.org/sqlite":             SQLite,
	"github.com/mattn/go-sqlite3":    SQLite,
}

var dialectName = map[Dialect]string{Postgres: "Postgres", MySQL: "MySQL", SQLite: "SQLite"}

// driverDialect is the package of db's driver type and its dialect, "" for
// a driver Std does not know (one wrapped by another package, say) or a
// *sql.DB that sql.Open did not make (its Driver panics).
func driverDialect(db *sql.DB) (pkg string, d Dialect) {
	defer func() { _ = recover() }()
	t := reflect.TypeOf(db.Driver())
	if t == nil {
		return "", ""
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.PkgPath(), driverPkgs[t.PkgPath()]
}

func (d stdDriver) Dialect() Dialect { return d.dialect }
func (d stdDriver) DB() Executor {
	if d.err != nil {
		return failExec{d.err}
	}
	return stdExec{q: d.db}
}
func (d stdDriver) Tx(tx *sql.Tx) Executor {
	if d.err != nil {
		return failExec{d.err}
	}
	return stdExec{q: tx, tx: true}
}
func (d stdDriver) MaxConns() int {
	if d.db == nil {
		return 0
	}
	return d.db.Stats().MaxOpenConnections
}

func (d stdDriver) Begin(ctx context.Context, opts *sql.TxOptions, setup string) (*sql.Tx, error) {
	if d.err != nil {
		return nil, d.err
	}
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

func (d stdDriver) Listen(ctx context.Context, channel string, wake func(), every time.Duration, idle func(context.Context, Executor)) error {
	if d.dialect != Postgres {
		return fmt.Errorf("sqldb: LISTEN is PostgreSQL's: %w", errors.ErrUnsupported)
	}
	if d.err != nil {
		return d.err
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
		return errors.Join(listenOn(ctx, pc.Conn(), channel, wake, every, idle), driver.ErrBadConn)
	})
}

// listenOn runs LISTEN on c and waits for notifications until ctx ends or
// c fails, and calls idle on c every that long (see Driver.Listen). A wait
// cut short by its deadline leaves c usable: pgx closes a connection only
// on an error other than a timeout.
func listenOn(ctx context.Context, c *pgx.Conn, channel string, wake func(), every time.Duration, idle func(context.Context, Executor)) error {
	if _, err := c.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	wake()
	polls := every > 0 && idle != nil
	next := time.Now().Add(every)
	for {
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if polls {
			wctx, cancel = context.WithDeadline(ctx, next)
		}
		_, err := c.WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil:
			wake()
		case ctx.Err() != nil || !polls || !errors.Is(wctx.Err(), context.DeadlineExceeded) || c.IsClosed():
			return err
		default:
			idle(ctx, pgxExec{q: c})
			next = time.Now().Add(every)
		}
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

// errNilPool is the error of every statement on Std(nil, d) or Pgx(nil),
// drivers that only name a dialect (for printing DDL).
var errNilPool = errors.New("sqldb: the driver's pool is nil (Std(nil, dialect) and Pgx(nil) only name a dialect, for printing DDL)")

// failExec is the Executor of a driver that cannot run statements: each
// returns err.
type failExec struct{ err error }

func (e failExec) Exec(context.Context, string, ...any) (int64, error)   { return 0, e.err }
func (e failExec) QueryRow(context.Context, string, []any, ...any) error { return e.err }
func (e failExec) Query(context.Context, string, []any, func(func(...any) error) error) error {
	return e.err
}
func (e failExec) QueryRowEach(context.Context, string, [][]any, func(int) []any) ([]bool, error) {
	return nil, e.err
}
func (e failExec) Columns(context.Context, string) (map[string]string, error) { return nil, e.err }
func (e failExec) InTx() bool                                                 { return false }
func (e failExec) Alive(context.Context) error                                { return e.err }
