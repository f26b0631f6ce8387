package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// The values of -driver.
const (
	driverAuto = "auto" // pgx for postgres://, database/sql otherwise
	driverPgx  = "pgx"  // sqldb.Pgx on a pgxpool.Pool; PostgreSQL only
	driverSQL  = "sql"  // sqldb.Std on database/sql (pgx's stdlib driver for PostgreSQL)
)

// driverFlag defines the -driver flag of the commands that work on a
// database.
func driverFlag(fs *flag.FlagSet) *string {
	return fs.String("driver", driverAuto, "how to reach the database: pgx (a pgxpool.Pool; postgres:// only), sql (database/sql), or auto: pgx for postgres://, sql otherwise")
}

// dedupeStore is what the commands use of a dedupe.SQLStore, whatever its
// driver's transaction type.
type dedupeStore interface {
	Check(ctx context.Context) error
	Prune(ctx context.Context, before time.Time) (int64, error)
	Schema() []string
	Lookup(ctx context.Context, scope, key string) (dedupe.KeyState, bool, error)
	InFlight(ctx context.Context, limit int) ([]dedupe.KeyState, error)
}

// outboxStore is what the commands use of an outbox.Outbox, whatever its
// driver's transaction type.
type outboxStore interface {
	Check(ctx context.Context) error
	Schema() []string
	SchemaUpgrade() []string
	Status(ctx context.Context) (outbox.Status, error)
	Prune(ctx context.Context, before time.Time) (int64, error)
	Failed(ctx context.Context, sel outbox.Selection) ([]outbox.FailedRow, error)
	Requeue(ctx context.Context, sel outbox.Selection) (int64, error)
}

// database is the database a command works on: one sqldb.Driver, of the
// driver -driver chose, and the dedupe store and outbox built on it. The
// driver is named in openDatabase (and schemaDatabase) only: no command
// knows which one it runs on.
type database struct {
	dialect sqldb.Dialect
	// driver is driverPgx or driverSQL.
	driver string
	// pool runs statements on the database, outside any transaction.
	pool      sqldb.Executor
	newStore  func(dedupe.SQLConfig) (dedupeStore, error)
	newOutbox func(outbox.Config) (outboxStore, error)
	// newParked builds the parked-message store on the database;
	// replayParked replays rows of it through the outbox of a topic.
	newParked    func(parked.Config) (parkedStore, error)
	replayParked func(ctx context.Context, s parkedStore, outboxTopic string, f parked.Filter, opts parked.ReplayOptions) (parked.ReplayResult, error)
	console      func(context.Context, consoleSetup) (http.Handler, error)
	close        func() error
}

// on is the database of db, reached through driver (driverPgx or
// driverSQL) and closed by closeDB.
func on[TTx any](db sqldb.Driver[TTx], driver string, closeDB func() error) *database {
	newParked, replayParked := parkedOn(db)
	return &database{
		newParked:    newParked,
		replayParked: replayParked,
		dialect:      db.Dialect(),
		driver:       driver,
		pool:         db.DB(),
		newStore: func(cfg dedupe.SQLConfig) (dedupeStore, error) {
			s, err := dedupe.NewSQLStore(db, cfg)
			if err != nil {
				return nil, err
			}
			return s, nil
		},
		newOutbox: func(cfg outbox.Config) (outboxStore, error) {
			o, err := outbox.New(db, cfg)
			if err != nil {
				return nil, err
			}
			return o, nil
		},
		console: func(ctx context.Context, setup consoleSetup) (http.Handler, error) {
			return consoleOn(ctx, db, setup)
		},
		close: closeDB,
	}
}

func (d *database) Close() error { return d.close() }

// checker is a store whose tables can be checked: a dedupe store, an
// outbox, a parked-message store.
type checker interface {
	Check(ctx context.Context) error
}

// openStore opens the database at dbURL through driver (openDatabase) and
// builds a store on it with build; an error of build is one of the flag
// named flagName (the store's -table or -topic). The caller closes the
// database.
func openStore[S checker](e *env, dbURL, driver, flagName string, build func(*database) (S, error)) (*database, S, error) {
	var none S
	d, err := openDatabase(e, dbURL, driver)
	if err != nil {
		return nil, none, err
	}
	s, err := build(d)
	if err != nil {
		return nil, none, errors.Join(fmt.Errorf("%s: %w", flagName, err), d.Close())
	}
	return d, s, nil
}

// openChecked is openStore, then a check of the store's tables (a missing
// table is an error that says how to create it). The caller closes the
// database.
func openChecked[S checker](e *env, dbURL, driver, flagName string, build func(*database) (S, error)) (*database, S, error) {
	d, s, err := openStore(e, dbURL, driver, flagName, build)
	if err != nil {
		return nil, s, err
	}
	if err := s.Check(e.ctx); err != nil {
		return nil, s, errors.Join(err, d.Close())
	}
	return d, s, nil
}

// dedupeTable builds the dedupe store of table, for openStore.
func dedupeTable(table string) func(*database) (dedupeStore, error) {
	return func(d *database) (dedupeStore, error) { return d.newStore(dedupe.SQLConfig{Table: table}) }
}

// openDatabase opens and pings the database at flagURL (or the one the
// environment names) through driver (a -driver value). The caller closes it.
func openDatabase(e *env, flagURL, driver string) (*database, error) {
	rawURL, from := flagURL, "-db"
	if rawURL == "" {
		var name string
		rawURL, name = settleenv.DatabaseURL(e.getenv)
		from = "$" + name
	}
	var dialect sqldb.Dialect
	if rawURL != "" {
		if _, _, d, err := sqlurl.Parse(rawURL); err == nil {
			dialect = d
		}
	}
	switch driver {
	case driverAuto:
		if dialect != sqldb.Postgres {
			driver = driverSQL
		} else {
			driver = driverPgx
		}
	case driverPgx:
		if rawURL != "" && dialect != "" && dialect != sqldb.Postgres {
			return nil, &usageError{msg: fmt.Sprintf("-driver pgx works with postgres:// only, and %s is %s", from, dialect)}
		}
	case driverSQL:
	default:
		return nil, &usageError{msg: fmt.Sprintf("-driver: %q is not pgx, sql or auto", driver)}
	}
	if driver == driverSQL || dialect != sqldb.Postgres {
		// openDB resolves the URL again and reports a missing or bad one.
		db, d, err := openDB(e, flagURL)
		if err != nil {
			return nil, err
		}
		return on(sqldb.Std(db, d), driverSQL, db.Close), nil
	}
	if _, _, _, err := sqlurl.Parse(rawURL); err != nil {
		return nil, &usageError{msg: fmt.Sprintf("%s: %s", from, strings.TrimPrefix(err.Error(), "sqlurl: "))}
	}
	cfg, err := pgxpool.ParseConfig(rawURL)
	if err != nil {
		// pgx redacts the URL it quotes, but not always what its parser
		// says of it.
		return nil, &usageError{msg: fmt.Sprintf("%s: %v", from, sqlurl.ScrubError(err, rawURL))}
	}
	cfg.MaxConns = 4 // a command runs a few statements, one after the other
	pctx, cancel := context.WithTimeout(e.ctx, connectTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err == nil {
		err = pool.Ping(pctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		return nil, fmt.Errorf("%s: cannot reach the postgres database at %s: %w", from, redact(rawURL), sqlurl.ScrubError(err, rawURL))
	}
	return on(sqldb.Pgx(pool), driverPgx, func() error { pool.Close(); return nil }), nil
}

// schemaDatabase is a database of dialect that is never connected to, for
// the statements of `dedupe schema` and `outbox schema`: they come from the
// same store and outbox as every other command's, and need no server.
func schemaDatabase(dialect string) *database {
	db := sql.OpenDB(noConnector{})
	return on(sqldb.Std(db, sqldb.Dialect(dialect)), driverSQL, db.Close)
}

// noConnector is the connector of schemaDatabase: it refuses to connect.
type noConnector struct{}

var errNoConnection = errors.New("settle: the schema commands do not connect to a database")

func (noConnector) Connect(context.Context) (driver.Conn, error) { return nil, errNoConnection }
func (noConnector) Driver() driver.Driver                        { return noDriver{} }

type noDriver struct{}

func (noDriver) Open(string) (driver.Conn, error) { return nil, errNoConnection }
