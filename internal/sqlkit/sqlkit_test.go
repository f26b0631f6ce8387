package sqlkit_test

import (
	"errors"
	"fmt"
	"testing"

	_ "github.com/go-sql-driver/mysql"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestMySQLNumber reads the number of a real server error through the
// driver's own type, wrapped as settle wraps errors.
func TestMySQLNumber(t *testing.T) {
	db := testenv.MySQL(t)
	_, err := db.ExecContext(t.Context(), "SELEC 1")
	if err == nil {
		t.Fatal("no error")
	}
	wrapped := errors.Join(errors.New("other"), fmt.Errorf("claim: %w", err))
	n, ok := sqlkit.MySQLNumber(wrapped)
	if !ok || n != 1064 {
		t.Fatalf("MySQLNumber(%v) = %d, %v; want 1064 (syntax error)", err, n, ok)
	}
	if _, ok := sqlkit.MySQLNumber(errors.New("Error 1064")); ok {
		t.Fatal("a plain error with the same text was taken for the driver's")
	}
	pg := testenv.Postgres(t)
	_, err = pg.ExecContext(t.Context(), "SELEC 1")
	if s := sqlkit.SQLState(err); s != "42601" {
		t.Fatalf("SQLState = %q, want 42601", s)
	}
	if _, ok := sqlkit.MySQLNumber(err); ok {
		t.Fatal("a PostgreSQL error taken for MySQL's")
	}
}

func TestQuoteAndValidate(t *testing.T) {
	for _, c := range []struct {
		d    sqldb.Dialect
		name string
		want string
	}{
		{sqldb.Postgres, "a.b", `"a"."b"`},
		{sqldb.MySQL, "t", "`t`"},
		{sqldb.SQLite, "t_1", `"t_1"`},
	} {
		if err := sqlkit.ValidTable(c.name); err != nil {
			t.Fatal(err)
		}
		if got := sqlkit.Quote(c.d, c.name); got != c.want {
			t.Fatalf("Quote(%s, %s) = %s, want %s", c.d, c.name, got, c.want)
		}
	}
	for _, bad := range []string{"", "a;b", `a"b`, "a.b.c", "1a", "a b"} {
		if sqlkit.ValidTable(bad) == nil {
			t.Fatalf("ValidTable(%q) accepted it", bad)
		}
	}
}

func TestMismatch(t *testing.T) {
	create := "CREATE TABLE t (\n  k BYTEA NOT NULL,\n  n BIGINT NOT NULL,\n  PRIMARY KEY (k)\n)"
	if c, p := sqlkit.Mismatch(map[string]string{"k": "BYTEA", "n": "INT8"}, create); c != "" {
		t.Fatalf("a matching table: %s %s", c, p)
	}
	if c, _ := sqlkit.Mismatch(map[string]string{"k": "BYTEA"}, create); c != "n" {
		t.Fatalf("missing n: got %q", c)
	}
	if c, _ := sqlkit.Mismatch(map[string]string{"k": "TEXT", "n": "INT8"}, create); c != "k" {
		t.Fatalf("k of the wrong kind: got %q", c)
	}
}
