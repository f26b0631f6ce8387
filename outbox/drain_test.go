package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// TestDrainWaitsForTheBatchToCount: Drain returns only once what this relay
// forwarded is in Counts. The relay's commit is held back after the server
// has committed (a connection whose Commit returns late), so that other
// connections already see no row pending while the batch has not counted
// its rows yet.
func TestDrainWaitsForTheBatchToCount(t *testing.T) {
	t.Parallel()
	urls := []struct{ name, env string }{
		{"sqlite", ""},
		{"postgres", testenv.PostgresURLEnv},
		{"mysql", testenv.MySQLURLEnv},
	}
	for _, u := range urls {
		t.Run(u.name, func(t *testing.T) {
			t.Parallel()
			url := "sqlite://" + filepath.Join(t.TempDir(), "settle.db")
			if u.env != "" {
				url = testenv.Require(t, u.env)
			}
			db, slow := openLateCommit(t, url)
			e := setup(t, drv{name: u.name, open: func(testing.TB) testenv.DB { return db }})
			const orders = 3
			for i := range orders {
				e.placeOrder(t, t.Context(), "D-"+string(rune('1'+i)), true, message.NewMessage("drain-"+string(rune('1'+i)), []byte(`{}`)))
			}
			slow.Store(int64(300 * time.Millisecond))
			r, err := e.ob.NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- r.Run(t.Context()) }()
			t.Cleanup(func() {
				if err := r.Close(); err != nil {
					t.Error(err)
				}
				if err := <-done; err != nil {
					t.Error(err)
				}
			})
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			if err := r.Drain(ctx); err != nil {
				t.Fatal(err)
			}
			if fwd, _ := r.Counts(); fwd != orders {
				t.Fatalf("after Drain, Counts: %d forwarded, want %d", fwd, orders)
			}
		})
	}
}

// openLateCommit opens url through a connector whose transactions return
// from Commit the returned duration (0 at first) after the database has
// committed.
func openLateCommit(t *testing.T, url string) (testenv.DB, *atomic.Int64) {
	t.Helper()
	base, dialect := connectorOf(t, url)
	late := new(atomic.Int64)
	db := sql.OpenDB(lateConnector{Connector: base, late: late})
	t.Cleanup(func() { _ = db.Close() })
	if dialect == sqldb.SQLite {
		db.SetMaxOpenConns(4)
	}
	return testenv.DB{DB: db, Dialect: dialect}, late
}

// connectorOf returns the driver connector of url's database, for a test
// to wrap, and its dialect.
func connectorOf(t *testing.T, url string) (driver.Connector, sqldb.Dialect) {
	t.Helper()
	name, dsn, dialect, err := sqlurl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := sql.Open(name, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = plain.Close() }()
	var base driver.Connector = dsnConnector{d: plain.Driver(), dsn: dsn}
	if dc, ok := plain.Driver().(driver.DriverContext); ok {
		if base, err = dc.OpenConnector(dsn); err != nil {
			t.Fatal(err)
		}
	}
	return base, dialect
}

// dsnConnector is the connector of a driver that has none of its own.
type dsnConnector struct {
	d   driver.Driver
	dsn string
}

func (c dsnConnector) Connect(context.Context) (driver.Conn, error) { return c.d.Open(c.dsn) }
func (c dsnConnector) Driver() driver.Driver                        { return c.d }

type lateConnector struct {
	driver.Connector
	late *atomic.Int64
}

func (c lateConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &lateConn{Conn: cn, late: c.late}, nil
}

// lateConn passes everything to its driver's connection, and wraps the
// transactions it begins.
type lateConn struct {
	driver.Conn
	late *atomic.Int64
}

func (c *lateConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return lateTx{Tx: tx, late: c.late}, nil
}

func (c *lateConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if e, ok := c.Conn.(driver.ExecerContext); ok {
		return e.ExecContext(ctx, query, args)
	}
	return nil, driver.ErrSkip
}

func (c *lateConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if q, ok := c.Conn.(driver.QueryerContext); ok {
		return q.QueryContext(ctx, query, args)
	}
	return nil, driver.ErrSkip
}

func (c *lateConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if p, ok := c.Conn.(driver.ConnPrepareContext); ok {
		return p.PrepareContext(ctx, query)
	}
	return c.Conn.Prepare(query)
}

func (c *lateConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *lateConn) IsValid() bool {
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

func (c *lateConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

type lateTx struct {
	driver.Tx
	late *atomic.Int64
}

func (tx lateTx) Commit() error {
	err := tx.Tx.Commit()
	if d := time.Duration(tx.late.Load()); d > 0 && !errors.Is(err, driver.ErrBadConn) {
		time.Sleep(d)
	}
	return err
}
