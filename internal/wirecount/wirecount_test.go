package wirecount_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/internal/wirecount"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func start(t *testing.T, rawURL string) (*wirecount.Proxy, string) {
	t.Helper()
	p, u, err := wirecount.Start(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, u
}

// A simple query, a prepared one and a LISTEN are one statement each, and
// the connection that LISTENs is the backend pg_stat_activity shows at the
// port Listening returns.
func TestPostgres(t *testing.T) {
	t.Parallel()
	p, u := start(t, testenv.Require(t, testenv.PostgresURLEnv))
	ctx := t.Context()
	c, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(context.Background()) }()
	if got := p.Listening(); len(got) != 0 {
		t.Fatalf("Listening before any LISTEN = %v", got)
	}

	before := p.Statements()
	if _, err := c.Exec(ctx, "SELECT 1"); err != nil { // no argument: a simple Query
		t.Fatal(err)
	}
	var n int
	if err := c.QueryRow(ctx, "SELECT $1::int + 1", 41).Scan(&n); err != nil { // Parse, Describe, Sync; Bind, Execute, Sync
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, `LISTEN "wirecount_test"`); err != nil {
		t.Fatal(err)
	}
	if got := p.Statements() - before; got != 3 {
		t.Errorf("3 statements counted as %d; messages: %s", got, p.Messages())
	}
	if m := p.Messages(); !strings.Contains(m, "Parse=1") || !strings.Contains(m, "Execute=1") {
		t.Errorf("messages %s, want one Parse and one Execute", m)
	}

	ports := p.Listening()
	if len(ports) != 1 {
		t.Fatalf("Listening = %v, want the one connection", ports)
	}
	db := testenv.Postgres(t)
	var pid uint32
	if err := db.QueryRowContext(ctx, "SELECT pid FROM pg_stat_activity WHERE client_port = $1", ports[0]).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if pid != c.PgConn().PID() {
		t.Errorf("pg_stat_activity's backend at port %d is %d, the LISTENing connection's is %d", ports[0], pid, c.PgConn().PID())
	}

	// The server ends the connection: it leaves the list.
	if _, err := db.ExecContext(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(p.Listening()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("Listening = %v 10 s after the backend was terminated", p.Listening())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A query, a ping and a prepared statement's execution are one statement
// each; the prepare and the close are not counted.
func TestMySQL(t *testing.T) {
	t.Parallel()
	p, u := start(t, testenv.Require(t, testenv.MySQLURLEnv))
	db, _, err := sqlurl.Open(u)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	ctx := t.Context()
	c, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	before := p.Statements()
	if _, err := c.ExecContext(ctx, "DO 1"); err != nil {
		t.Fatal(err)
	}
	if err := c.PingContext(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := c.PrepareContext(ctx, "SELECT ? + 1")
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := st.QueryRowContext(ctx, 41).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if got := p.Statements() - before; got != 3 {
		t.Errorf("3 statements counted as %d; messages: %s", got, p.Messages())
	}
	if m := p.Messages(); !strings.Contains(m, "COM_STMT_PREPARE=1") || !strings.Contains(m, "COM_PING=1") {
		t.Errorf("messages %s, want one COM_STMT_PREPARE and one COM_PING", m)
	}
	if got := p.Listening(); len(got) != 0 {
		t.Errorf("Listening on MySQL = %v", got)
	}
}

func TestStartRefusesOtherSchemes(t *testing.T) {
	t.Parallel()
	if _, _, err := wirecount.Start("redis://127.0.0.1:6379"); err == nil {
		t.Fatal("a redis URL was accepted")
	}
}
