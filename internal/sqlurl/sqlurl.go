// Package sqlurl opens a database/sql handle from a URL, so that examples,
// tests and commands take one setting per database:
//
//	postgres://user:pass@host:5432/db?sslmode=disable   (pgx stdlib driver)
//	mysql://user:pass@host:3306/db                      (go-sql-driver/mysql)
//	sqlite:///path/to/file.db or sqlite://relative.db   (modernc.org/sqlite)
//
// No error of this package shows a password: messages are built from
// [Redact]'s form of the URL, which also serves the callers' own messages.
package sqlurl

import (
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	_ "modernc.org/sqlite"             // registers "sqlite"

	"github.com/settle-go/settle/sqldb"
)

// Open parses u, opens the matching driver and returns the handle with its
// dialect. It does not connect; call PingContext to find out whether the
// server is there. Connections to PostgreSQL and MySQL are dialled with
// Dialer (TCP keepalive and user timeout).
func Open(u string) (*sql.DB, sqldb.Dialect, error) {
	driver, dsn, dialect, err := Parse(u)
	if err != nil {
		return nil, "", err
	}
	var db *sql.DB
	switch dialect {
	case sqldb.Postgres:
		db, err = openPostgres(dsn) // with Dialer's keepalive and user timeout
	case sqldb.MySQL:
		db, err = openMySQL(dsn)
	default:
		db, err = sql.Open(driver, dsn)
	}
	if err != nil {
		return nil, "", fmt.Errorf("sqlurl: open %s: %w", dialect, ScrubError(err, u))
	}
	if dialect == sqldb.SQLite {
		// One writer at a time is all SQLite allows; more connections only
		// turn waiting into SQLITE_BUSY errors.
		db.SetMaxOpenConns(4)
	}
	return db, dialect, nil
}

// Parse returns the driver name, driver DSN and dialect for u. Its errors
// never show a password: they are built from Redact(u), and from what a
// parser says of the redacted URL.
func Parse(u string) (driver, dsn string, dialect sqldb.Dialect, err error) {
	scheme, rest, ok := strings.Cut(u, "://")
	if !ok {
		return "", "", "", fmt.Errorf("sqlurl: %q is not a URL (want postgres://, mysql:// or sqlite://)", Redact(u))
	}
	switch scheme {
	case "postgres", "postgresql":
		// pgx parses the URL when it connects; a URL it cannot read is
		// refused here, where the message can be made safe.
		if _, err := parseURL(u); err != nil {
			return "", "", "", err
		}
		return "pgx", u, sqldb.Postgres, nil
	case "mysql":
		pu, err := parseURL(u)
		if err != nil {
			return "", "", "", err
		}
		cfg := mysql.NewConfig()
		cfg.Net = "tcp"
		cfg.Addr = pu.Host
		if pu.Port() == "" {
			cfg.Addr = pu.Hostname() + ":3306"
		}
		cfg.User = pu.User.Username()
		cfg.Passwd, _ = pu.User.Password()
		cfg.DBName = strings.TrimPrefix(pu.Path, "/")
		for k, v := range pu.Query() {
			if cfg.Params == nil {
				cfg.Params = map[string]string{}
			}
			cfg.Params[k] = v[0]
		}
		return "mysql", cfg.FormatDSN(), sqldb.MySQL, nil
	case "sqlite", "sqlite3", "file":
		path := rest
		if path == "" {
			return "", "", "", fmt.Errorf("sqlurl: %q names no file", Redact(u))
		}
		return "sqlite", SQLiteDSN(path), sqldb.SQLite, nil
	}
	return "", "", "", fmt.Errorf("sqlurl: unsupported scheme %q in %q (want postgres, mysql or sqlite)", scheme, Redact(u))
}

// parseURL parses u with net/url. Its error is built from the redacted URL:
// url.Parse quotes its input, and a password holding an unencoded / or ?
// moves the host's end into the password, so that even its complaint
// ("invalid port") quotes a piece of it.
func parseURL(u string) (*url.URL, error) {
	pu, err := url.Parse(u)
	if err == nil {
		return pu, nil
	}
	safe := Redact(u)
	if _, rerr := url.Parse(safe); rerr != nil {
		var ue *url.Error
		if errors.As(rerr, &ue) {
			rerr = ue.Err
		}
		return nil, fmt.Errorf("sqlurl: %q is not a valid URL: %w", safe, rerr)
	}
	// Only the user information differs: the password holds characters
	// that a URL must percent-encode.
	return nil, fmt.Errorf("sqlurl: %q is not a valid URL: percent-encode the user name and password (/ as %%2F, ? as %%3F, # as %%23, @ as %%40, %% as %%25)", safe)
}

// SQLitePath returns the file path of a sqlite:// URL (sqlite:///abs/path,
// sqlite://relative/path).
func SQLitePath(u string) string {
	_, rest, _ := strings.Cut(u, "://")
	return rest
}

// SQLiteDSN returns a modernc.org/sqlite DSN for the file at path, with the
// settings settle needs: WAL, a busy timeout so concurrent writers wait
// instead of failing, and BEGIN IMMEDIATE so a transaction takes the write
// lock up front instead of failing when it upgrades.
func SQLiteDSN(path string) string {
	return "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_txlock=immediate"
}
