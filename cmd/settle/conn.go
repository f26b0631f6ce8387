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

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
)

// Environment variables read for connection settings, the same as the
// examples'.
const (
	envDBURL   = "SETTLE_DB_URL"
	envAMQPURL = "SETTLE_AMQP_URL"
)

// connectTimeout bounds dialling the broker and the first ping of a database.
const connectTimeout = 10 * time.Second

var osGetenv = os.Getenv

// openDB opens and pings the database at rawURL, or at $SETTLE_DB_URL when
// rawURL is empty. The caller closes it.
func openDB(e *env, rawURL string) (*sql.DB, dedupe.Dialect, error) {
	ctx := e.ctx
	if rawURL == "" {
		rawURL = e.getenv(envDBURL)
	}
	if rawURL == "" {
		return nil, "", fmt.Errorf("-db: no database URL (set -db or %s)", envDBURL)
	}
	db, dialect, err := sqlurl.Open(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("-db: %s", strings.TrimPrefix(err.Error(), "sqlurl: "))
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		return nil, "", fmt.Errorf("-db: cannot reach the %s database at %s: %w", dialect, redact(rawURL), err)
	}
	return db, dialect, nil
}

// dialAMQP connects to the broker at rawURL. The caller closes the
// connection.
func dialAMQP(ctx context.Context, rawURL string) (*amqp091.Connection, error) {
	if rawURL == "" {
		return nil, fmt.Errorf("-amqp: no broker URL (set -amqp or %s)", envAMQPURL)
	}
	uri, err := amqp091.ParseURI(rawURL)
	if err != nil {
		return nil, fmt.Errorf("-amqp: %q: %w", redact(rawURL), err)
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
		return nil, fmt.Errorf("-amqp: cannot connect to the broker at %s: %w", addr, err)
	}
	return conn, nil
}

// redact hides the password of a URL.
func redact(u string) string {
	if pu, err := url.Parse(u); err == nil && pu.User != nil {
		return pu.Redacted()
	}
	return u
}

// isNotFound reports whether err is the broker's 404 NOT_FOUND (a passive
// declare of a queue that does not exist).
func isNotFound(err error) bool {
	var ae *amqp091.Error
	return errors.As(err, &ae) && ae.Code == amqp091.NotFound
}

// queueDepth returns how many messages are ready on queue, or an error
// saying that there is no such queue. It uses a channel of its own, since a
// failed passive declare closes the channel.
func queueDepth(conn *amqp091.Connection, queue string) (int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		if isNotFound(err) {
			return 0, fmt.Errorf("no queue named %q", queue)
		}
		return 0, fmt.Errorf("queue %q: %w", queue, err)
	}
	_ = ch.Close()
	return q.Messages, nil
}
