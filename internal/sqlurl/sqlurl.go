// Package sqlurl opens a database/sql handle from a URL, so that examples,
// tests and commands take one setting per database:
//
//	postgres://user:pass@host:5432/db?sslmode=disable   (pgx stdlib driver)
//	mysql://user:pass@host:3306/db                      (go-sql-driver/mysql)
//	sqlite:///path/to/file.db or sqlite://relative.db   (modernc.org/sqlite)
package sqlurl

import (
	"database/sql"
	"fmt"
	"net/url"
	"strings"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	_ "modernc.org/sqlite"             // registers "sqlite"

	"github.com/settle-go/settle/dedupe"
)

// Open parses u, opens the matching driver and returns the handle with its
// dialect. It does not connect; call PingContext to find out whether the
// server is there. Connections to PostgreSQL and MySQL are dialled with
// Dialer (TCP keepalive and user timeout).
func Open(u string) (*sql.DB, dedupe.Dialect, error) {
	driver, dsn, dialect, err := Parse(u)
	if err != nil {
		return nil, "", err
	}
	var db *sql.DB
	switch dialect {
	case dedupe.Postgres:
		db, err = openPostgres(dsn) // with Dialer's keepalive and user timeout
	case dedupe.MySQL:
		db, err = openMySQL(dsn)
	default:
		db, err = sql.Open(driver, dsn)
	}
	if err != nil {
		return nil, "", fmt.Errorf("sqlurl: open %s: %w", dialect, err)
	}
	if dialect == dedupe.SQLite {
		// One writer at a time is all SQLite allows; more connections only
		// turn waiting into SQLITE_BUSY errors.
		db.SetMaxOpenConns(4)
	}
	return db, dialect, nil
}

// Parse returns the driver name, driver DSN and dialect for u.
func Parse(u string) (driver, dsn string, dialect dedupe.Dialect, err error) {
	scheme, rest, ok := strings.Cut(u, "://")
	if !ok {
		return "", "", "", fmt.Errorf("sqlurl: %q is not a URL (want postgres://, mysql:// or sqlite://)", redact(u))
	}
	switch scheme {
	case "postgres", "postgresql":
		return "pgx", u, dedupe.Postgres, nil
	case "mysql":
		pu, err := url.Parse(u)
		if err != nil {
			return "", "", "", fmt.Errorf("sqlurl: %w", err)
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
		return "mysql", cfg.FormatDSN(), dedupe.MySQL, nil
	case "sqlite", "sqlite3", "file":
		path := rest
		if path == "" {
			return "", "", "", fmt.Errorf("sqlurl: %q names no file", u)
		}
		return "sqlite", SQLiteDSN(path), dedupe.SQLite, nil
	}
	return "", "", "", fmt.Errorf("sqlurl: unsupported scheme %q (want postgres, mysql or sqlite)", scheme)
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

func redact(u string) string {
	if pu, err := url.Parse(u); err == nil && pu.User != nil {
		return pu.Redacted()
	}
	return u
}
