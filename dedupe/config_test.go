package dedupe_test

import (
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

func TestNewSQLStoreRefusesBadConfig(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	cases := []struct {
		name  string
		cfg   dedupe.SQLConfig
		field string
	}{
		{"no dialect", dedupe.SQLConfig{}, "SQLConfig.Dialect"},
		{"unknown dialect", dedupe.SQLConfig{Dialect: "oracle"}, "SQLConfig.Dialect"},
		{"injection in table", dedupe.SQLConfig{Dialect: dedupe.SQLite, Table: `x"; DROP TABLE y; --`}, "SQLConfig.Table"},
		{"table with space", dedupe.SQLConfig{Dialect: dedupe.Postgres, Table: "my table"}, "SQLConfig.Table"},
		{"three-part name", dedupe.SQLConfig{Dialect: dedupe.Postgres, Table: "a.b.c"}, "SQLConfig.Table"},
		{"identifier too long", dedupe.SQLConfig{Dialect: dedupe.MySQL, Table: strings.Repeat("t", 64)}, "SQLConfig.Table"},
		{"negative prune batch", dedupe.SQLConfig{Dialect: dedupe.MySQL, PruneBatch: -1}, "SQLConfig.PruneBatch"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, err := dedupe.NewSQLStore(db, c.cfg)
			if err == nil || s != nil {
				t.Fatalf("NewSQLStore(%+v) = %v, %v; want an error", c.cfg, s, err)
			}
			if !strings.Contains(err.Error(), c.field) {
				t.Fatalf("error %q does not name %s", err, c.field)
			}
		})
	}
	if _, err := dedupe.NewSQLStore(nil, dedupe.SQLConfig{Dialect: dedupe.SQLite}); err == nil {
		t.Fatal("NewSQLStore(nil db) succeeded")
	}
	if _, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: dedupe.Postgres, Table: "settle.dedupe"}); err != nil {
		t.Fatalf("schema-qualified table refused: %v", err)
	}
}

func TestSchemaQuotesAndValidates(t *testing.T) {
	t.Parallel()
	for _, d := range dedupe.Dialects() {
		stmts, err := dedupe.Schema(d, "")
		if err != nil || len(stmts) == 0 || !strings.Contains(stmts[0], dedupe.DefaultTable) {
			t.Fatalf("Schema(%s, \"\") = %v, %v; want the default table", d, stmts, err)
		}
		if _, err := dedupe.Schema(d, "bad-name"); err == nil {
			t.Fatalf("Schema(%s, bad-name) accepted an invalid identifier", d)
		}
	}
	if _, err := dedupe.Schema("oracle", "t"); err == nil {
		t.Fatal("Schema accepted an unknown dialect")
	}
}
