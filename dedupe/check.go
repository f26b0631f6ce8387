package dedupe

import (
	"context"
	"fmt"
	"strings"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// Check reports whether the store can work: the database answers, and the
// claims table exists with the columns (and kinds of column) of
// [SQLStore.Schema]. A missing or mis-shaped table is a *[sqldb.SchemaError],
// wrapping [sqldb.ErrSchema], whose text gives the statements to run. Call
// it where the service starts, so that a missing migration is one clear
// error instead of deliveries deferred while the table is missing. It reads
// no rows and writes nothing.
func (s *SQLStore[TTx]) Check(ctx context.Context) error {
	if err := s.ex.QueryRow(ctx, "SELECT 1", nil, new(int)); err != nil {
		return fmt.Errorf("dedupe: check: the database does not answer: %w", err)
	}
	t := sqlkit.Quote(s.dialect, s.table)
	have, err := s.ex.Columns(ctx, "SELECT * FROM "+t+" WHERE 1 = 0")
	if err != nil {
		return &sqldb.SchemaError{Table: s.table, Problem: fmt.Sprintf("it cannot be read (%v)", err), DDL: s.Schema()}
	}
	create := s.Schema()[0]
	if i := strings.LastIndex(create, "\n)"); i > 0 {
		create = create[:i+2] // the column list, without a partitioning clause
	}
	col, problem := sqlkit.Mismatch(have, create)
	if col == "" {
		return nil
	}
	if _, ok := have["first_at"]; !ok && col == "first_at" {
		// Added after the first release: an existing table needs it added.
		typ := "BIGINT"
		if s.dialect == sqldb.SQLite {
			typ = "INTEGER"
		}
		return &sqldb.SchemaError{
			Table:   s.table,
			Problem: "column first_at is missing (a table made by an earlier version)",
			DDL:     []string{"ALTER TABLE " + t + " ADD COLUMN first_at " + typ + " NOT NULL DEFAULT 0"},
		}
	}
	return &sqldb.SchemaError{Table: s.table, Problem: problem, DDL: s.Schema()}
}
