package dedupe

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// ErrSchema is wrapped by the error of [SQLStore.Check] when the claims
// table is missing or does not have the shape the store needs.
var ErrSchema = errors.New("dedupe: claims table missing or mis-shaped")

// SchemaError is what [SQLStore.Check] found wrong with the claims table,
// with the statements that create it as the store needs it.
type SchemaError struct {
	Table   string
	Problem string   // what is wrong: the table cannot be read, a column is missing...
	DDL     []string // the statements of [SQLStore.Schema]
}

func (e *SchemaError) Error() string {
	return fmt.Sprintf("%v: table %s: %s; create it with:\n%s;", ErrSchema, e.Table, e.Problem, strings.Join(e.DDL, ";\n"))
}

// Unwrap returns ErrSchema.
func (e *SchemaError) Unwrap() error { return ErrSchema }

// Check reports whether the store can work: the database answers, and the
// claims table exists with the columns (and kinds of column) of [Schema]. A
// missing or mis-shaped table is a *SchemaError, wrapping ErrSchema, whose
// text gives the statements to run. Call it where the service starts, so
// that a missing migration is one clear error instead of deliveries deferred
// while the table is missing. It reads no rows and writes nothing.
func (s *SQLStore) Check(ctx context.Context) error {
	e, ok := s.ex.(sqlExec)
	if !ok {
		return errors.New("dedupe: check: the store does not run on database/sql")
	}
	if err := e.db.QueryRowContext(ctx, "SELECT 1").Scan(new(int)); err != nil {
		return fmt.Errorf("dedupe: check: the database does not answer: %w", err)
	}
	rows, err := e.db.QueryContext(ctx, "SELECT * FROM "+s.dialect.quote(s.table)+" WHERE 1 = 0")
	if err != nil {
		return s.schemaErr(fmt.Sprintf("it cannot be read (%v)", err))
	}
	defer rows.Close()
	types, err := rows.ColumnTypes()
	if err != nil {
		return fmt.Errorf("dedupe: check: reading the columns of %s: %w", s.table, err)
	}
	have := make(map[string]string, len(types))
	for _, t := range types {
		have[strings.ToLower(t.Name())] = strings.ToUpper(t.DatabaseTypeName())
	}
	if err := s.checkColumns(have); err != nil {
		return err
	}
	return rows.Err()
}

func (s *SQLStore) schemaErr(problem string) error {
	return &SchemaError{Table: s.table, Problem: problem, DDL: s.Schema()}
}

// checkColumns compares the claims table's columns (lower-case name to
// upper-case database type name, "" when unknown) with Schema's.
func (s *SQLStore) checkColumns(have map[string]string) error {
	for _, c := range schemaColumns(s.Schema()[0]) {
		got, ok := have[c.name]
		if !ok && c.name == "first_at" {
			// Added after the first release: an existing table needs it added.
			return s.schemaErr(fmt.Sprintf("column first_at is missing (a table made by an earlier version: ALTER TABLE %s ADD COLUMN first_at %s NOT NULL DEFAULT 0)", s.dialect.quote(s.table), c.typ))
		}
		if !ok {
			return s.schemaErr(fmt.Sprintf("column %s is missing", c.name))
		}
		if want := typeKind(c.typ); got != "" && typeKind(got) != "" && typeKind(got) != want {
			return s.schemaErr(fmt.Sprintf("column %s is %s, want %s", c.name, got, c.typ))
		}
	}
	return nil
}

type schemaColumn struct{ name, typ string }

// schemaColumns reads the columns of a CREATE TABLE statement of Schema: one
// per line, name then type.
func schemaColumns(create string) []schemaColumn {
	var cols []schemaColumn
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
		case "index", "primary", "unique", "constraint":
			continue
		}
		typ := strings.ToUpper(f[1])
		if i := strings.IndexByte(typ, '('); i > 0 {
			typ = typ[:i]
		}
		cols = append(cols, schemaColumn{name, typ})
	}
	return cols
}

// typeKind groups a column type into binary, integer or text, as drivers
// name it; "" when unknown, which Check does not judge.
func typeKind(t string) string {
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
