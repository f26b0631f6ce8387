package pipeline

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/settle-go/settle/internal/sqlkit"
)

// ErrConnectionLost is wrapped by the error of a delivery whose
// transaction lost its database connection (the server ended the session,
// the connection was reset or closed, the driver found it broken): the
// database's trouble, not the message's. The transaction is run again on a
// new connection, after BusyDelay, up to three times; after that the delivery
// is deferred (the error also wraps dedupe.ErrUnavailable), no attempt spent.
// A commit behind the dedupe middleware that lost its connection is deferred
// at once: whether it landed, the redelivery's claim says.
var ErrConnectionLost = errors.New("pipeline: the transaction's database connection was lost")

// connReruns is how many times a transaction that lost its connection is run
// again, on a new one, before its deliveries are deferred.
const connReruns = 3

// connTrouble reports whether err, from a call on a transaction's
// connection, says that the database went away under it rather than that
// the statement failed: what no fault of a message causes. The classes:
//
//   - the driver's own word: driver.ErrBadConn, sql.ErrConnDone, pgconn's
//     ErrConnClosed, the go-sql-driver's ErrInvalidConn (see
//     mysqlInvalidConn), and pgconn errors
//     that happened before anything was sent (SafeToRetry) or while
//     connecting (ConnectError);
//   - PostgreSQL: SQLSTATE class 08 (connection exception), 57P01
//     admin_shutdown (pg_terminate_backend, a fast shutdown), 57P02
//     crash_shutdown, 57P03 cannot_connect_now;
//   - MySQL/MariaDB: 1053 server shutdown, 1927 connection killed, 2006
//     server gone, 2013 and 2055 connection lost;
//   - the network under the connection: a *net.OpError, io.EOF or
//     io.ErrUnexpectedEOF, ECONNRESET, ECONNABORTED, ECONNREFUSED, EPIPE,
//     ETIMEDOUT;
//   - settle's own deadline on the call (ErrCallTimeout).
//
// Not in it, because they are the transaction's or the handler's own: a
// serialization failure or deadlock (40001, 40P01, 1213: the handler's
// transaction met another and is retried as an attempt, so a conflict that
// never resolves still ends), a lock or statement timeout (55P03, 57014,
// 1205), and a session ended for idling in its transaction (PostgreSQL
// 25P03, MySQL 4031: the handler held the transaction idle longer than the
// server allows, and would again).
//
// A handler's error in these classes may still come from something else
// than its transaction (an HTTP client's *net.OpError, a second database),
// so the handler paths also ask the transaction whether its connection is
// alive (handlerLostConnection).
func connTrouble(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrCallTimeout) || errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, pgconn.ErrConnClosed) || mysqlInvalidConn(err) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pgConnTrouble(pe.Code)
	}
	if n, ok := sqlkit.MySQLNumber(err); ok {
		return mysqlConnTrouble(n)
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) || pgconn.SafeToRetry(err) {
		return true
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		return true
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNABORTED) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ETIMEDOUT)
}

// pgConnTrouble reports whether a PostgreSQL SQLSTATE says the session went
// away (see connTrouble).
func pgConnTrouble(code string) bool {
	switch code {
	case "57P01", "57P02", "57P03":
		return true
	}
	return len(code) == 5 && code[:2] == "08"
}

// mysqlConnTrouble reports whether a MySQL/MariaDB error number says the
// session went away (see connTrouble).
func mysqlConnTrouble(n uint16) bool {
	switch n {
	case 1053, 1927, 2006, 2013, 2055:
		return true
	}
	return false
}

// handlerLostConnection reports whether err, returned by a handler's
// function running in t, is t's connection going away: an error of
// connTrouble's classes, and t's connection found dead too (t.probe). A
// handler's own failure stays its own: any other error, a class error while
// the connection still answers, and settle's deadline on the handler's call
// (ErrCallTimeout: a handler that overruns cannot be told apart from a
// silent connection, and one that always overruns must still end
// dead-lettered).
func handlerLostConnection(ctx context.Context, t txn, err error) bool {
	if errors.Is(err, ErrCallTimeout) || !connTrouble(err) {
		return false
	}
	return connTrouble(t.probe(ctx))
}

// withConnLost is err wrapped so that it wraps ErrConnectionLost (as it is
// when it does already).
func withConnLost(err error) error {
	if errors.Is(err, ErrConnectionLost) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrConnectionLost, err)
}

// mysqlInvalidConnText is the text of go-sql-driver/mysql's ErrInvalidConn.
const mysqlInvalidConnText = "invalid connection"

// mysqlInvalidConn reports go-sql-driver/mysql's ErrInvalidConn in err's
// chain, without importing the driver (which would register "mysql" for
// every program that imports settle). It is what reaches settle, rather
// than driver.ErrBadConn, when the connection breaks while the driver
// reads a statement's answer (the server was killed or the connection
// reset mid-statement: the driver closes the connection and returns
// ErrInvalidConn, not the network's error), and from Commit or Rollback on
// a connection it has closed; database/sql passes it on as it is. The
// driver returns driver.ErrBadConn only when it finds the connection dead
// before writing anything. ErrInvalidConn is a plain errors.New value, so
// it is recognised by its concrete type (the errors package's) and its
// text; the test of this package checks it against the driver's own
// variable.
func mysqlInvalidConn(err error) bool {
	for _, e := range sqlkit.Chain(err) {
		if e.Error() == mysqlInvalidConnText && reflect.TypeOf(e) == plainErrorType {
			return true
		}
	}
	return false
}

// plainErrorType is the concrete type of errors.New's errors.
var plainErrorType = reflect.TypeOf(errors.New(""))
