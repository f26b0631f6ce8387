package dedupe_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// Check says what is wrong with the claims table and how to create it: a
// missing table, a missing column, a column of the wrong kind; and it
// accepts the table that Schema creates.
func TestCheck(t *testing.T) {
	t.Parallel()
	type checker interface {
		Check(context.Context) error
		Schema() []string
	}
	for _, d := range append(testenv.Databases(), struct {
		Name string
		Open func(testing.TB) testenv.DB
	}{"postgres-pgx", testenv.Postgres}) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			q := func(s string) string {
				if db.Dialect == sqldb.MySQL {
					return "`" + s + "`"
				}
				return `"` + s + `"`
			}
			store := func(table string) checker {
				if d.Name == "postgres-pgx" {
					s, err := dedupe.NewSQLStore(testenv.Pgx(t), dedupe.SQLConfig{Table: table})
					if err != nil {
						t.Fatal(err)
					}
					return s
				}
				s, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
				if err != nil {
					t.Fatal(err)
				}
				return s
			}

			good := testenv.DedupeTable(t, db)
			if err := store(good).Check(t.Context()); err != nil {
				t.Fatalf("Check of the table Schema made: %v", err)
			}

			missing := testenv.Name(t, "dd_missing")
			err := store(missing).Check(t.Context())
			var se *sqldb.SchemaError
			if !errors.As(err, &se) || !errors.Is(err, sqldb.ErrSchema) || se.Table != missing {
				t.Fatalf("Check of a missing table = %v; want a *SchemaError for %s", err, missing)
			}
			if !strings.Contains(err.Error(), "CREATE TABLE IF NOT EXISTS "+q(missing)) {
				t.Fatalf("the error does not give the DDL to run:\n%v", err)
			}

			noCol := testenv.Name(t, "dd_nocol")
			wrongType := testenv.Name(t, "dd_wrongtype")
			old := testenv.Name(t, "dd_old") // made before first_at existed
			for table, ddl := range map[string]string{
				old:       strings.Replace(withoutLine(store(old).Schema()[0], "first_at"), ",\n)", "\n)", 1),
				noCol:     withoutLine(store(noCol).Schema()[0], "token"),
				wrongType: strings.Replace(store(wrongType).Schema()[0], "attempts", "attempts   TEXT NOT NULL, spare", 1),
			} {
				if _, err := db.ExecContext(t.Context(), ddl); err != nil {
					t.Fatalf("%s: %v", ddl, err)
				}
				t.Cleanup(func() { _, _ = db.ExecContext(t.Context(), "DROP TABLE IF EXISTS "+q(table)) })
			}
			if err := store(noCol).Check(t.Context()); !errors.As(err, &se) || !strings.Contains(se.Problem, "column token is missing") {
				t.Fatalf("Check of a table without token = %v", err)
			}
			if err := store(old).Check(t.Context()); !errors.As(err, &se) || len(se.DDL) != 1 || !strings.Contains(se.DDL[0], "ADD COLUMN first_at") {
				t.Fatalf("Check of a table made before first_at = %v; want the ALTER TABLE to run", err)
			}
			if err := store(wrongType).Check(t.Context()); !errors.As(err, &se) || !strings.Contains(se.Problem, "column attempts is") {
				t.Fatalf("Check of a table whose attempts is text = %v", err)
			}
		})
	}
}

// withoutLine returns ddl without its line that contains s.
func withoutLine(ddl, s string) string {
	var keep []string
	for line := range strings.SplitSeq(ddl, "\n") {
		if !strings.Contains(line, s) {
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "\n")
}
