package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// stmtCount counts the statements a database/sql pool asks its driver to
// run: SQLite's "wire", which has none. A statement is an Exec or a Query
// (on the connection or a prepared statement; preparing and closing one
// are not counted), a BEGIN, a COMMIT, a ROLLBACK or a ping.
type stmtCount struct {
	mu    sync.Mutex
	n     int64
	kinds map[string]int
}

func (c *stmtCount) add(kind string) {
	c.mu.Lock()
	c.n++
	c.kinds[kind]++
	c.mu.Unlock()
}

func (c *stmtCount) Statements() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

func (c *stmtCount) Messages() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var parts []string
	for k, n := range c.kinds {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// openCounted opens a new SQLite file of the test through a driver that
// counts its statements.
func openCounted(t *testing.T) (testenv.DB, *stmtCount) {
	t.Helper()
	base, dialect := connectorOf(t, "sqlite://"+t.TempDir()+"/settle.db")
	c := &stmtCount{kinds: map[string]int{}}
	db := sql.OpenDB(countConnector{Connector: base, c: c})
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(4) // as sqlurl.Open
	if dialect != sqldb.SQLite {
		t.Fatalf("dialect %s", dialect)
	}
	return testenv.DB{DB: db, Dialect: dialect}, c
}

type countConnector struct {
	driver.Connector
	c *stmtCount
}

func (k countConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := k.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countConn{Conn: conn, c: k.c}, nil
}

// countConn needs its driver's connection to have the context methods
// (modernc.org/sqlite's has).
type countConn struct {
	driver.Conn
	c *stmtCount
}

func (k *countConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	k.c.add("BEGIN")
	tx, err := k.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return countTx{Tx: tx, c: k.c}, nil
}

func (k *countConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	res, err := k.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	if err != driver.ErrSkip { //nolint:errorlint // the sentinel, unwrapped
		k.c.add("Exec")
	}
	return res, err
}

func (k *countConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	rows, err := k.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	if err != driver.ErrSkip { //nolint:errorlint // the sentinel, unwrapped
		k.c.add("Query")
	}
	return rows, err
}

func (k *countConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	st, err := k.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return countStmt{Stmt: st, c: k.c}, nil
}

func (k *countConn) Ping(ctx context.Context) error {
	k.c.add("Ping")
	if p, ok := k.Conn.(driver.Pinger); ok {
		return p.Ping(ctx)
	}
	return nil
}

func (k *countConn) ResetSession(ctx context.Context) error {
	if r, ok := k.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

type countTx struct {
	driver.Tx
	c *stmtCount
}

func (k countTx) Commit() error   { k.c.add("COMMIT"); return k.Tx.Commit() }
func (k countTx) Rollback() error { k.c.add("ROLLBACK"); return k.Tx.Rollback() }

type countStmt struct {
	driver.Stmt
	c *stmtCount
}

func (k countStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	k.c.add("Exec")
	return k.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (k countStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	k.c.add("Query")
	return k.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}
