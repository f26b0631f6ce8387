package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/sqldb"
)

// The values of -driver.
const (
	driverAuto = "auto" // pgx for postgres://, database/sql otherwise
	driverPgx  = "pgx"  // a pgxpool.Pool and settle's Pgx functions; PostgreSQL only
	driverSQL  = "sql"  // database/sql (pgx's stdlib driver for PostgreSQL)
)

// driverFlag defines the -driver flag of the commands that work on a
// database.
func driverFlag(fs *flag.FlagSet) *string {
	return fs.String("driver", driverAuto, "how to reach the database: pgx (a pgxpool.Pool; postgres:// only), sql (database/sql), or auto: pgx for postgres://, sql otherwise")
}

// database is what the database commands run on: database/sql, or a
// pgxpool.Pool for PostgreSQL.
type database struct {
	dialect sqldb.Dialect
	// db is the database/sql handle; nil on pgx.
	db *sql.DB
	// pool is the pgx pool; nil on database/sql.
	pool *pgxpool.Pool
}

func (d *database) Close() error {
	if d.pool != nil {
		d.pool.Close()
		return nil
	}
	return d.db.Close()
}

// openDatabase opens and pings the database at rawURL (or the one the
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
		return &database{dialect: d, db: db}, nil
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
	return &database{dialect: sqldb.Postgres, pool: pool}, nil
}
