package sqlurl

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// How a connection settle opens finds out that its peer is gone, when the
// network drops its packets silently: keepalive probes after 15s idle, every
// 5s, 3 unanswered ones end it; data sent and not acknowledged for
// UserTimeout ends it (Linux's TCP_USER_TIMEOUT; the kernel's default is
// some 15 minutes of retransmissions). These bound what the client's kernel
// can know; settle's own deadlines (dedupe.Config.StoreTimeout,
// pipeline.TxConfig.CallTimeout) bound each call whatever the network does.
const (
	KeepAliveIdle     = 15 * time.Second
	KeepAliveInterval = 5 * time.Second
	KeepAliveCount    = 3
	UserTimeout       = 30 * time.Second
)

// Dialer returns the dialer of the connections settle opens: TCP keepalive
// as above and, on Linux, TCP_USER_TIMEOUT.
func Dialer() *net.Dialer {
	return &net.Dialer{
		Timeout: 30 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable: true, Idle: KeepAliveIdle, Interval: KeepAliveInterval, Count: KeepAliveCount,
		},
		Control: userTimeout(UserTimeout),
	}
}

// openPostgres opens the pgx stdlib driver on dsn with Dialer.
func openPostgres(dsn string) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err // pgx's parse error hides the password
	}
	cfg.DialFunc = Dialer().DialContext
	return stdlib.OpenDB(*cfg), nil
}

// openMySQL opens the go-sql-driver on dsn with Dialer.
func openMySQL(dsn string) (*sql.DB, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, errors.New("the DSN built from the URL does not parse") // its text could name the password
	}
	d := Dialer()
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		return d.DialContext(ctx, network, addr)
	}
	c, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("connector: %w", err)
	}
	return sql.OpenDB(c), nil
}
