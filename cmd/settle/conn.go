package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/sqldb"
)

// Environment variables read for connection settings, the same as the
// examples' and the tests' (internal/settleenv).
const (
	envAMQPURL = settleenv.AMQPURL
	envHelp    = settleenv.Help
)

// connectTimeout bounds dialling the broker and the first ping of a database.
const connectTimeout = 10 * time.Second

var osGetenv = os.Getenv

// openDB opens and pings the database at rawURL, or at the one the
// environment names (settleenv.DatabaseURL) when rawURL is empty. The
// caller closes it. A URL that cannot be parsed is a usage error; a SQLite
// file that does not exist is an error, and is not created.
func openDB(e *env, rawURL string) (*sql.DB, sqldb.Dialect, error) {
	ctx := e.ctx
	from := "-db"
	if rawURL == "" {
		rawURL, from = settleenv.DatabaseURL(e.getenv)
		from = "$" + from
	}
	if rawURL == "" {
		return nil, "", &usageError{msg: fmt.Sprintf("-db: no database URL (set -db, %s or %s)", settleenv.PostgresURL, settleenv.MySQLURL)}
	}
	_, _, dialect, err := sqlurl.Parse(rawURL)
	if err != nil {
		return nil, "", &usageError{msg: fmt.Sprintf("%s: %s", from, strings.TrimPrefix(err.Error(), "sqlurl: "))}
	}
	if dialect == sqldb.SQLite {
		// Opening a SQLite file creates it: an operator's typo would leave
		// an empty database behind and report empty tables.
		path := sqlurl.SQLitePath(rawURL)
		if _, err := os.Stat(path); err != nil {
			return nil, "", fmt.Errorf("%s: no SQLite database at %s: %w", from, path, err)
		}
	}
	db, dialect, err := sqlurl.Open(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %s", from, strings.TrimPrefix(err.Error(), "sqlurl: "))
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		// A driver's error may quote the connection string.
		return nil, "", fmt.Errorf("%s: cannot reach the %s database at %s: %w", from, dialect, redact(rawURL), sqlurl.ScrubError(err, rawURL))
	}
	return db, dialect, nil
}

// dialAMQP connects to the broker at rawURL. The caller closes the
// connection.
func dialAMQP(ctx context.Context, rawURL string) (*amqp091.Connection, error) {
	if rawURL == "" {
		return nil, &usageError{msg: fmt.Sprintf("-amqp: no broker URL (set -amqp or %s)", envAMQPURL)}
	}
	uri, err := amqp091.ParseURI(rawURL)
	if err != nil {
		return nil, &usageError{msg: "-amqp: " + amqpURLError(rawURL) + " (want amqp://user:password@host:5672/)"}
	}
	addr := net.JoinHostPort(uri.Host, fmt.Sprint(uri.Port))
	dialer := &net.Dialer{Timeout: connectTimeout}
	conn, err := amqp091.DialConfig(rawURL, amqp091.Config{
		Properties: amqp091.NewConnectionProperties(),
		Heartbeat:  10 * time.Second,
		Locale:     "en_US",
		Dial: func(network, a string) (net.Conn, error) {
			dctx, cancel := context.WithTimeout(ctx, connectTimeout)
			defer cancel()
			c, err := dialer.DialContext(dctx, network, a)
			if err != nil {
				return nil, err
			}
			// The handshake must finish in time too.
			if err := c.SetDeadline(time.Now().Add(connectTimeout)); err != nil {
				_ = c.Close()
				return nil, err
			}
			return c, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("-amqp: cannot connect to the broker at %s: %w", addr, sqlurl.ScrubError(err, rawURL))
	}
	return conn, nil
}

// amqpURLError says what is wrong with an AMQP URL that amqp091 refuses,
// without the password: amqp091's error quotes the URL (url.Parse's does),
// so it is taken from the redacted URL, and when that one parses, only the
// user information can be wrong.
func amqpURLError(rawURL string) string {
	safe := redact(rawURL)
	_, err := amqp091.ParseURI(safe)
	if err == nil {
		return fmt.Sprintf("%q: not a valid URL: percent-encode the user name and password (/ as %%2F, ? as %%3F, # as %%23, @ as %%40, %% as %%25)", safe)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return fmt.Sprintf("%q: %v", safe, err)
}

// redact hides the passwords and tokens of a connection string, in any form
// (sqlurl.Redact). Every connection string that goes into a message passes
// through it first.
func redact(u string) string { return sqlurl.Redact(u) }

// isNotFound reports whether err is the broker's 404 NOT_FOUND (a passive
// declare of a queue that does not exist).
func isNotFound(err error) bool {
	var ae *amqp091.Error
	return errors.As(err, &ae) && ae.Code == amqp091.NotFound
}

// queueDepth returns how many messages are ready on queue, or an error
// saying that there is no such queue.
func queueDepth(conn *amqp091.Connection, queue string) (int, error) {
	q, err := inspectQueue(conn, queue)
	return q.Messages, err
}
