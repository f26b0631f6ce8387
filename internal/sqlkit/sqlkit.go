// Package sqlkit holds what settle's SQL packages (dedupe, outbox,
// pipeline, the CLI) need alike and write once: table names checked and
// quoted, a table's columns compared with its CREATE TABLE, and the
// classes of database errors settle acts on, recognised by type, without
// importing any driver (so that importing settle registers none).
package sqlkit

import (
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"

	"github.com/settle-go/settle/sqldb"
)

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$`)

// ValidTable checks that name is a plain identifier, optionally qualified
// by one schema name. Quoting is added by Quote, so names never need
// escaping and never come from message data.
func ValidTable(name string) error {
	if !identRE.MatchString(name) {
		return fmt.Errorf("table name %q is not a valid identifier (letters, digits and _, optionally schema.table, at most 63 characters each)", name)
	}
	return nil
}

// ValidDialect checks that d is one of sqldb's dialects.
func ValidDialect(d sqldb.Dialect) error {
	switch d {
	case sqldb.Postgres, sqldb.MySQL, sqldb.SQLite:
		return nil
	}
	return fmt.Errorf("unknown dialect %q (want postgres, mysql or sqlite)", string(d))
}

// Quote quotes a name ValidTable accepted, each part on its own: "a"."b",
// or `a`.`b` on MySQL.
func Quote(d sqldb.Dialect, name string) string {
	q := `"`
	if d == sqldb.MySQL {
		q = "`"
	}
	parts := strings.Split(name, ".")
	for i, p := range parts {
		parts[i] = q + p + q
	}
	return strings.Join(parts, ".")
}

// Column is a column of a CREATE TABLE statement.
type Column struct{ Name, Type string }

// CreateColumns reads the columns of a CREATE TABLE statement written one
// per line, name then type, as settle's schemas are.
func CreateColumns(create string) []Column {
	var cols []Column
	open := strings.IndexByte(create, '(')
	closing := strings.LastIndexByte(create, ')')
	if open < 0 || closing < open {
		return nil
	}
	for line := range strings.SplitSeq(create[open+1:closing], "\n") {
		f := strings.Fields(strings.TrimSuffix(strings.TrimSpace(line), ","))
		if len(f) < 2 {
			continue
		}
		name := strings.ToLower(strings.Trim(f[0], "`\""))
		switch name {
		case "index", "primary", "unique", "constraint", "key":
			continue
		}
		typ := strings.ToUpper(f[1])
		if i := strings.IndexByte(typ, '('); i > 0 {
			typ = typ[:i]
		}
		cols = append(cols, Column{name, typ})
	}
	return cols
}

// TypeKind groups a column type into binary, integer or text, as drivers
// name it; "" when unknown, which a check does not judge.
func TypeKind(t string) string {
	if i := strings.IndexByte(t, '('); i > 0 {
		t = t[:i]
	}
	switch strings.ToUpper(t) {
	case "BYTEA", "BLOB", "VARBINARY", "BINARY", "LONGBLOB", "MEDIUMBLOB":
		return "binary"
	case "SMALLINT", "INT2", "INT4", "INT8", "INT", "INTEGER", "BIGINT", "TINYINT", "MEDIUMINT":
		return "integer"
	case "TEXT", "VARCHAR", "CHAR", "BPCHAR", "NVARCHAR", "LONGTEXT", "MEDIUMTEXT", "TINYTEXT":
		return "text"
	}
	return ""
}

// Mismatch compares have (Executor.Columns of a table) with the columns of
// its CREATE TABLE statement: the first column missing, or of another kind,
// and a sentence that says so; "" when none.
func Mismatch(have map[string]string, create string) (column, problem string) {
	for _, c := range CreateColumns(create) {
		got, ok := have[c.Name]
		if !ok {
			return c.Name, fmt.Sprintf("column %s is missing", c.Name)
		}
		if want := TypeKind(c.Type); got != "" && TypeKind(got) != "" && TypeKind(got) != want {
			return c.Name, fmt.Sprintf("column %s is %s, want %s", c.Name, got, c.Type)
		}
	}
	return "", ""
}

// SQLState is the SQLSTATE of a PostgreSQL error (pgconn.PgError, through
// pgx or its database/sql driver), "" for another error.
func SQLState(err error) string {
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return pe.SQLState()
	}
	return ""
}

// mysqlPkg is go-sql-driver/mysql's import path: its *MySQLError is
// recognised by package path and type name, so that settle does not import
// the driver (which would register "mysql" for every program that imports
// settle).
const mysqlPkg = "github.com/go-sql-driver/mysql"

// MySQLNumber is the error number of a MySQL or MariaDB server error
// (go-sql-driver/mysql's *MySQLError) in err's chain, and whether there is
// one.
func MySQLNumber(err error) (uint16, bool) {
	for _, e := range Chain(err) {
		v := reflect.ValueOf(e)
		if v.Kind() != reflect.Pointer || v.IsNil() {
			continue
		}
		t := v.Type().Elem()
		if t.PkgPath() != mysqlPkg || t.Name() != "MySQLError" {
			continue
		}
		f := v.Elem().FieldByName("Number")
		if f.IsValid() && f.Kind() == reflect.Uint16 {
			return uint16(f.Uint()), true
		}
	}
	return 0, false
}

// SQLiteCode is the extended result code of a SQLite error
// (modernc.org/sqlite's *Error), and whether err has one.
func SQLiteCode(err error) (int, bool) {
	var se interface{ Code() int }
	if errors.As(err, &se) {
		return se.Code(), true
	}
	return 0, false
}

// Deadlock reports a statement the database rolled back to break a
// deadlock: PostgreSQL 40P01, MySQL/MariaDB 1213.
func Deadlock(err error) bool {
	if n, ok := MySQLNumber(err); ok {
		return n == 1213
	}
	return SQLState(err) == "40P01"
}

// Conflict reports a statement of a caller's transaction refused over a
// row changed since the transaction's snapshot: PostgreSQL's serialization
// failure (40001), InnoDB's 1020 under innodb_snapshot_isolation, SQLite's
// busy snapshot (517). The transaction cannot go on.
func Conflict(err error) bool {
	if n, ok := MySQLNumber(err); ok {
		return n == 1020
	}
	if s := SQLState(err); s != "" {
		return s == "40001"
	}
	c, ok := SQLiteCode(err)
	return ok && c == 517
}

// Chain is err and every error it wraps, depth first (an error with
// Unwrap() []error is followed into each of its errors in turn).
func Chain(err error) []error {
	var out []error
	var walk func(error)
	walk = func(e error) {
		for e != nil {
			out = append(out, e)
			switch u := e.(type) {
			case interface{ Unwrap() []error }:
				for _, x := range u.Unwrap() {
					walk(x)
				}
				return
			case interface{ Unwrap() error }:
				e = u.Unwrap()
			default:
				return
			}
		}
	}
	walk(err)
	return out
}
