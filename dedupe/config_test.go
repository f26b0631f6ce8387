package dedupe_test

import (
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

func TestNewSQLStoreRefusesBadConfig(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	cases := []struct {
		name    string
		dialect sqldb.Dialect
		cfg     dedupe.SQLConfig
		field   string
	}{
		{"no dialect", "", dedupe.SQLConfig{}, "db.Dialect()"},
		{"unknown dialect", "oracle", dedupe.SQLConfig{}, "db.Dialect()"},
		{"injection in table", sqldb.SQLite, dedupe.SQLConfig{Table: `x"; DROP TABLE y; --`}, "SQLConfig.Table"},
		{"table with space", sqldb.Postgres, dedupe.SQLConfig{Table: "my table"}, "SQLConfig.Table"},
		{"three-part name", sqldb.Postgres, dedupe.SQLConfig{Table: "a.b.c"}, "SQLConfig.Table"},
		{"identifier too long", sqldb.MySQL, dedupe.SQLConfig{Table: strings.Repeat("t", 64)}, "SQLConfig.Table"},
		{"negative prune batch", sqldb.MySQL, dedupe.SQLConfig{PruneBatch: -1}, "SQLConfig.PruneBatch"},
		{"partition under a second", sqldb.Postgres, dedupe.SQLConfig{Partition: time.Millisecond}, "SQLConfig.Partition"},
		{"negative partition", sqldb.MySQL, dedupe.SQLConfig{Partition: -time.Hour}, "SQLConfig.Partition"},
		{"partitioned SQLite", sqldb.SQLite, dedupe.SQLConfig{Partition: time.Hour}, "SQLConfig.Partition"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, err := dedupe.NewSQLStore(sqldb.Std(db.DB, c.dialect), c.cfg)
			if err == nil || s != nil {
				t.Fatalf("NewSQLStore(%+v) = %v, %v; want an error", c.cfg, s, err)
			}
			if !strings.Contains(err.Error(), c.field) {
				t.Fatalf("error %q does not name %s", err, c.field)
			}
		})
	}
	if _, err := dedupe.NewSQLStore[any](nil, dedupe.SQLConfig{}); err == nil {
		t.Fatal("NewSQLStore(nil db) succeeded")
	}
	if _, err := dedupe.NewSQLStore(sqldb.Std(db.DB, sqldb.Postgres), dedupe.SQLConfig{Table: "settle.dedupe"}); err != nil {
		t.Fatalf("schema-qualified table refused: %v", err)
	}
}

// The DDL of every dialect names the table, quoted, and the default table
// is settle_dedupe.
func TestSchemaQuotes(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	for _, d := range []sqldb.Dialect{sqldb.Postgres, sqldb.MySQL, sqldb.SQLite} {
		for table, want := range map[string]string{"": "settle_dedupe", "s.t": "t"} {
			s, err := dedupe.NewSQLStore(sqldb.Std(db.DB, d), dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			stmts := s.Schema()
			q := `"`
			if d == sqldb.MySQL {
				q = "`"
			}
			if len(stmts) == 0 || !strings.Contains(stmts[0], q+want+q) {
				t.Fatalf("%s: Schema() of table %q = %v; want the table %s quoted", d, table, stmts, want)
			}
		}
	}
}
