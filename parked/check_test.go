package parked_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// Check passes on the tables of Schema, and names a missing table or
// column with a *sqldb.SchemaError carrying the DDL; Park on a missing
// table fails (the delivery is then deferred, never acked).
func TestCheck(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		if err := e.Check(t.Context()); err != nil {
			t.Fatalf("Check of the tables of Schema = %v", err)
		}
		schemaErr := func(what, table, problem string) {
			t.Helper()
			// On a pool of its own: pgx's cached statement of the
			// earlier Check fails once when the table changed under it.
			err := e.another(t).Check(t.Context())
			var se *sqldb.SchemaError
			if !errors.Is(err, sqldb.ErrSchema) || !errors.As(err, &se) || se.Table != table ||
				!strings.Contains(se.Problem, problem) || !slices.Equal(se.DDL, e.Schema()) {
				t.Fatalf("Check with %s = %v; want a SchemaError of %s saying %q, with the DDL", what, err, table, problem)
			}
		}
		// A column missing from the groups table.
		if _, err := e.db.ExecContext(t.Context(), "ALTER TABLE "+e.q(e.table+"_groups")+" DROP COLUMN norm_text"); err != nil {
			t.Fatal(err)
		}
		schemaErr("a column missing", e.table+"_groups", "column norm_text is missing")
		// A column of the wrong kind in the rows table.
		if _, err := e.db.ExecContext(t.Context(), "ALTER TABLE "+e.q(e.table)+" DROP COLUMN archived_by"); err != nil {
			t.Fatal(err)
		}
		if _, err := e.db.ExecContext(t.Context(), "ALTER TABLE "+e.q(e.table)+" ADD COLUMN archived_by BIGINT"); err != nil {
			t.Fatal(err)
		}
		schemaErr("a column of another kind", e.table, "column archived_by is")
		// No table at all.
		if _, err := e.db.ExecContext(t.Context(), "DROP TABLE "+e.q(e.table)); err != nil {
			t.Fatal(err)
		}
		schemaErr("no table", e.table, "cannot be read")
		if err := e.Park(t.Context(), parkedMsg("u", "h", errBoom)); err == nil {
			t.Fatal("Park with no table = nil error; want an error, so that the delivery is deferred")
		}
	})
}

// New refuses a bad configuration, naming the field, and touches no
// database.
func TestConfig(t *testing.T) {
	t.Parallel()
	db := sqldb.Std(nil, sqldb.SQLite)
	for _, c := range []struct {
		cfg   parked.Config
		field string
	}{
		{parked.Config{Table: "bad name"}, "Config.Table"},
		{parked.Config{Table: "x; DROP TABLE y"}, "Config.Table"},
		{parked.Config{Table: strings.Repeat("t", 57)}, "Config.Table"},
		{parked.Config{MaxReplays: -1}, "Config.MaxReplays"},
	} {
		if _, err := parked.New(db, c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("New(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
	if _, err := parked.New[any](nil, parked.Config{}); err == nil {
		t.Error("New(nil) = nil error")
	}
	for _, ok := range []parked.Config{{}, {Table: strings.Repeat("t", 56)}, {Table: "app.parked", MaxReplays: 1}} {
		st, err := parked.New(db, ok)
		if err != nil {
			t.Errorf("New(%+v) = %v", ok, err)
			continue
		}
		if st.Schema()[0] == "" {
			t.Error("no DDL")
		}
	}
	// A nil message is refused, not parked.
	st, _ := parked.New(db, parked.Config{})
	if err := st.Park(t.Context(), settle.Parked{}); err == nil {
		t.Error("Park of no message = nil error")
	}
}
