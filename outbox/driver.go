package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
)

// conn is the one seam between the outbox's SQL and a driver. The statements
// (sql.go) are written once per dialect; a conn only carries them:
// watermill-sql's Beginner runs them (wsql.BeginnerFromStdSQL for a *sql.DB,
// wsql.BeginnerFromPgx for a pgxpool.Pool), and listen holds a connection in
// LISTEN. The publisher needs only the ContextExecutor part, the relay,
// Status, Check and Prune the whole of it.
type conn struct {
	wsql.Beginner
	// listen holds one connection in LISTEN on channel (a quoted
	// identifier), calls wake once the LISTEN is in place and at each
	// notification, and returns when ctx ends or the connection fails; the
	// connection is never handed back to a pool. errNoListen means the
	// driver cannot LISTEN: the relay polls.
	listen func(ctx context.Context, channel string, wake func()) error
	// maxConns is the pool's limit on open connections, 0 for none.
	maxConns func() int
}

// sqlConn is the conn of a *sql.DB.
func sqlConn(db *sql.DB) conn {
	return conn{
		Beginner: wsql.BeginnerFromStdSQL(db),
		listen: func(ctx context.Context, channel string, wake func()) error {
			return sqlListen(ctx, db, channel, wake)
		},
		maxConns: func() int { return db.Stats().MaxOpenConnections },
	}
}

// errNoListen means the database's driver is not pgx: the relay polls.
var errNoListen = errors.New("the driver of db is not pgx (github.com/jackc/pgx/v5/stdlib): no LISTEN, the relay polls")

func sqlListen(ctx context.Context, db *sql.DB, channel string, wake func()) error {
	c, err := db.Conn(ctx)
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

// rowsErr is the error that ended rs's iteration. watermill-sql's Rows has
// no Err, but both drivers' rows do (*sql.Rows, pgx.Rows); pgx reports a
// failed statement only there.
func rowsErr(rs wsql.Rows) error {
	if e, ok := rs.(interface{ Err() error }); ok {
		return e.Err()
	}
	return nil
}

// queryRow runs q, scans its first row into dest and reads the statement to
// its end; no row is sql.ErrNoRows.
func queryRow(ctx context.Context, ex wsql.ContextExecutor, q string, args []any, dest ...any) error {
	rs, err := ex.QueryContext(ctx, q, args...)
	if err != nil {
		return err
	}
	if !rs.Next() {
		err := rowsErr(rs)
		if err == nil {
			err = sql.ErrNoRows
		}
		return errors.Join(err, rs.Close())
	}
	serr := rs.Scan(dest...)
	cerr := rs.Close()
	return errors.Join(serr, cerr, rowsErr(rs))
}
