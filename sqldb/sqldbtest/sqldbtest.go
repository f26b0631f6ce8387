// Package sqldbtest is the conformance suite of sqldb.Driver: every driver
// settle runs on passes Run, on every database it supports. A new driver
// passes it before settle's stores, outbox and handlers are trusted on it.
package sqldbtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/settle-go/settle/sqldb"
)

// Run runs the suite on the driver that open returns, a new one for each
// test (open may return the same database each time: every test works in
// tables of its own, dropped when it ends).
func Run[TTx any](t *testing.T, open func(t *testing.T) sqldb.Driver[TTx]) {
	t.Run("ExecQuery", func(t *testing.T) { t.Parallel(); execQuery(t, open(t)) })
	t.Run("NoRows", func(t *testing.T) { t.Parallel(); noRows(t, open(t)) })
	t.Run("QueryRowEach", func(t *testing.T) { t.Parallel(); queryRowEach(t, open(t)) })
	t.Run("Columns", func(t *testing.T) { t.Parallel(); columns(t, open(t)) })
	t.Run("CommitRollback", func(t *testing.T) { t.Parallel(); commitRollback(t, open(t)) })
	t.Run("Setup", func(t *testing.T) { t.Parallel(); setup(t, open(t)) })
	t.Run("Isolation", func(t *testing.T) { t.Parallel(); isolation(t, open(t)) })
	t.Run("Alive", func(t *testing.T) { t.Parallel(); alive(t, open(t)) })
	t.Run("Listen", func(t *testing.T) { t.Parallel(); listen(t, open(t)) })
	t.Run("MaxConns", func(t *testing.T) {
		if m := open(t).MaxConns(); m < 0 {
			t.Fatalf("MaxConns %d", m)
		}
	})
}

// table creates a table of the test's own, (id INTEGER, v TEXT), and drops
// it when the test ends.
func table[TTx any](t *testing.T, d sqldb.Driver[TTx]) string {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "sqldbtest_" + hex.EncodeToString(b[:])
	if _, err := d.DB().Exec(t.Context(), "CREATE TABLE "+name+" (id INTEGER PRIMARY KEY, v VARCHAR(200) NOT NULL)"); err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	t.Cleanup(func() { _, _ = d.DB().Exec(context.Background(), "DROP TABLE "+name) })
	return name
}

// ph is the dialect's placeholder for argument n (from 1).
func ph(d sqldb.Dialect, n int) string {
	if d == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func insert[TTx any](t *testing.T, d sqldb.Driver[TTx], ex sqldb.Executor, tbl string, id int, v string) {
	t.Helper()
	n, err := ex.Exec(t.Context(), "INSERT INTO "+tbl+" (id, v) VALUES ("+ph(d.Dialect(), 1)+", "+ph(d.Dialect(), 2)+")", id, v)
	if err != nil || n != 1 {
		t.Fatalf("insert %d: %d rows, %v", id, n, err)
	}
}

func count[TTx any](t *testing.T, d sqldb.Driver[TTx], tbl string) int {
	t.Helper()
	var n int
	if err := d.DB().QueryRow(t.Context(), "SELECT COUNT(*) FROM "+tbl, nil, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

func execQuery[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	tbl := table(t, d)
	for i := 1; i <= 3; i++ {
		insert(t, d, d.DB(), tbl, i, fmt.Sprint("v", i))
	}
	n, err := d.DB().Exec(t.Context(), "UPDATE "+tbl+" SET v = 'x' WHERE id >= "+ph(d.Dialect(), 1), 2)
	if err != nil || n != 2 {
		t.Fatalf("update: %d rows affected, %v; want 2", n, err)
	}
	var got []string
	err = d.DB().Query(t.Context(), "SELECT id, v FROM "+tbl+" ORDER BY id", nil, func(scan func(...any) error) error {
		var id int
		var v string
		if err := scan(&id, &v); err != nil {
			return err
		}
		got = append(got, fmt.Sprint(id, v))
		return nil
	})
	if err != nil || strings.Join(got, ",") != "1v1,2x,3x" {
		t.Fatalf("query: %v, %v; want [1v1 2x 3x]", got, err)
	}
	stop := errors.New("stop")
	rows := 0
	err = d.DB().Query(t.Context(), "SELECT id FROM "+tbl, nil, func(func(...any) error) error { rows++; return stop })
	if !errors.Is(err, stop) || rows != 1 {
		t.Fatalf("an error from each: %v after %d rows; want it returned after 1", err, rows)
	}
	if err := d.DB().Query(t.Context(), "SELECT nothing FROM "+tbl, nil, func(func(...any) error) error { return nil }); err == nil {
		t.Fatal("a failed statement returned no error")
	}
}

func noRows[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	tbl := table(t, d)
	var v string
	err := d.DB().QueryRow(t.Context(), "SELECT v FROM "+tbl+" WHERE id = "+ph(d.Dialect(), 1), []any{7}, &v)
	if !errors.Is(err, sql.ErrNoRows) {
		t.Fatalf("QueryRow of no row on the pool: %v, want sql.ErrNoRows", err)
	}
	tx, err := d.Begin(t.Context(), nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Rollback(context.Background(), tx)
	err = d.Tx(tx).QueryRow(t.Context(), "SELECT v FROM "+tbl+" WHERE id = "+ph(d.Dialect(), 1), []any{7}, &v)
	if !errors.Is(err, sql.ErrNoRows) {
		t.Fatalf("QueryRow of no row in a transaction: %v, want sql.ErrNoRows", err)
	}
}

func queryRowEach[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	tbl := table(t, d)
	insert(t, d, d.DB(), tbl, 1, "one")
	insert(t, d, d.DB(), tbl, 3, "three")
	for _, ex := range []struct {
		name string
		ex   func() (sqldb.Executor, func())
	}{
		{"pool", func() (sqldb.Executor, func()) { return d.DB(), func() {} }},
		{"tx", func() (sqldb.Executor, func()) {
			tx, err := d.Begin(t.Context(), nil, "")
			if err != nil {
				t.Fatal(err)
			}
			return d.Tx(tx), func() { _ = d.Rollback(context.Background(), tx) }
		}},
	} {
		e, done := ex.ex()
		vals := make([]string, 4)
		found, err := e.QueryRowEach(t.Context(), "SELECT v FROM "+tbl+" WHERE id = "+ph(d.Dialect(), 1),
			[][]any{{1}, {2}, {3}, {4}}, func(i int) []any { return []any{&vals[i]} })
		done()
		if err != nil {
			t.Fatalf("%s: %v", ex.name, err)
		}
		if fmt.Sprint(found) != "[true false true false]" || vals[0] != "one" || vals[2] != "three" {
			t.Fatalf("%s: found %v, values %q", ex.name, found, vals)
		}
	}
}

func columns[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	tbl := table(t, d)
	have, err := d.DB().Columns(t.Context(), "SELECT * FROM "+tbl+" WHERE 1 = 0")
	if err != nil {
		t.Fatal(err)
	}
	if len(have) != 2 {
		t.Fatalf("columns %v, want id and v", have)
	}
	if typ, ok := have["v"]; !ok || typ != "" && !strings.Contains(typ, "CHAR") && typ != "TEXT" {
		t.Fatalf("column v: %q (present %v), want a character type", typ, ok)
	}
	if _, err := d.DB().Columns(t.Context(), "SELECT * FROM "+tbl+"_missing WHERE 1 = 0"); err == nil {
		t.Fatal("Columns of a missing table returned no error")
	}
}

func commitRollback[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	tbl := table(t, d)
	tx, err := d.Begin(t.Context(), nil, "")
	if err != nil {
		t.Fatal(err)
	}
	if !d.Tx(tx).InTx() || d.DB().InTx() {
		t.Fatal("InTx: want true in a transaction, false on the pool")
	}
	insert(t, d, d.Tx(tx), tbl, 1, "kept")
	if err := d.Commit(t.Context(), tx); err != nil {
		t.Fatal(err)
	}
	if err := d.Rollback(t.Context(), tx); err != nil {
		t.Fatalf("Rollback after Commit: %v, want nil", err)
	}
	tx, err = d.Begin(t.Context(), nil, "")
	if err != nil {
		t.Fatal(err)
	}
	insert(t, d, d.Tx(tx), tbl, 2, "gone")
	if err := d.Rollback(t.Context(), tx); err != nil {
		t.Fatal(err)
	}
	if err := d.Rollback(t.Context(), tx); err != nil {
		t.Fatalf("a second Rollback: %v, want nil", err)
	}
	if n := count(t, d, tbl); n != 1 {
		t.Fatalf("%d rows after a commit and a rollback, want 1", n)
	}
}

func setup[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	var stmt, read, want string
	switch d.Dialect() {
	case sqldb.Postgres:
		stmt, read, want = "SET LOCAL lock_timeout = '1234ms'", "SHOW lock_timeout", "1234ms"
	case sqldb.MySQL:
		stmt, read, want = "SET @sqldbtest_setup = 'on'", "SELECT @sqldbtest_setup", "on"
	default:
		stmt, read, want = "SELECT 1", "SELECT 'on'", "on"
	}
	tx, err := d.Begin(t.Context(), nil, stmt)
	if err != nil {
		t.Fatal(err)
	}
	var got string
	err = d.Tx(tx).QueryRow(t.Context(), read, nil, &got)
	_ = d.Rollback(context.Background(), tx)
	if err != nil || got != want {
		t.Fatalf("after setup %q: %s = %q, %v; want %q", stmt, read, got, err, want)
	}
	if _, err := d.Begin(t.Context(), nil, "SELECT nothing FROM nowhere"); err == nil {
		t.Fatal("a failed setup statement: Begin returned no error")
	}
}

func isolation[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	if d.Dialect() == sqldb.SQLite {
		t.Skip("SQLite has one isolation level")
	}
	// At REPEATABLE READ a row committed by another connection after the
	// transaction's first read is not seen; at READ COMMITTED it would be.
	tbl := table(t, d)
	tx, err := d.Begin(t.Context(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead}, "")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Rollback(context.Background(), tx)
	read := func() int {
		var n int
		if err := d.Tx(tx).QueryRow(t.Context(), "SELECT COUNT(*) FROM "+tbl, nil, &n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := read(); n != 0 {
		t.Fatalf("%d rows in a new table", n)
	}
	insert(t, d, d.DB(), tbl, 1, "later")
	if n := read(); n != 0 {
		t.Fatalf("a REPEATABLE READ transaction saw a row committed after its first read (%d rows): the isolation level was not set", n)
	}
}

func alive[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	if err := d.DB().Alive(t.Context()); err != nil {
		t.Fatalf("pool: %v", err)
	}
	tx, err := d.Begin(t.Context(), nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Rollback(context.Background(), tx)
	if err := d.Tx(tx).Alive(t.Context()); err != nil {
		t.Fatalf("tx: %v", err)
	}
	if d.Dialect() != sqldb.Postgres {
		return
	}
	// A statement that fails aborts the transaction, not its connection.
	_, _ = d.Tx(tx).Exec(t.Context(), "SELECT nothing FROM nowhere")
	if err := d.Tx(tx).Alive(t.Context()); err != nil && !strings.Contains(err.Error(), "25P02") {
		t.Fatalf("after a failed statement: %v", err)
	}
}

func listen[TTx any](t *testing.T, d sqldb.Driver[TTx]) {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var wakes atomic.Int32
	woke := make(chan struct{}, 16)
	channel := fmt.Sprintf(`"sqldbtest_%d"`, time.Now().UnixNano())
	done := make(chan error, 1)
	go func() {
		done <- d.Listen(ctx, channel, func() { wakes.Add(1); woke <- struct{}{} }, 0, nil)
	}()
	if d.Dialect() != sqldb.Postgres {
		select {
		case err := <-done:
			if !errors.Is(err, errors.ErrUnsupported) {
				t.Fatalf("Listen on %s: %v, want errors.ErrUnsupported", d.Dialect(), err)
			}
		case <-ctx.Done():
			t.Fatal("Listen did not return on a database without LISTEN")
		}
		return
	}
	select {
	case <-woke: // LISTEN in place
	case err := <-done:
		if errors.Is(err, errors.ErrUnsupported) {
			t.Skipf("this database/sql driver cannot LISTEN: %v", err)
		}
		t.Fatalf("Listen returned: %v", err)
	case <-ctx.Done():
		t.Fatal("no wake after LISTEN")
	}
	if _, err := d.DB().Exec(ctx, "SELECT pg_notify($1, 'x')", strings.Trim(channel, `"`)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-woke:
	case <-ctx.Done():
		t.Fatal("no wake after NOTIFY")
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Listen did not return when its context ended")
	}
}
