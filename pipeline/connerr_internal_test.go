package pipeline

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/poison"
)

// Each class of connTrouble, and the errors next to them that are a
// statement's or a handler's own failure.
func TestConnTroubleClasses(t *testing.T) {
	t.Parallel()
	refused := closedPortError(t)
	var connectErr error
	{
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		_, connectErr = pgconn.Connect(ctx, "postgres://postgres@"+refused.addr+"/x?connect_timeout=5")
		cancel()
		var ce *pgconn.ConnectError
		if !errors.As(connectErr, &ce) {
			t.Fatalf("pgconn.Connect to a closed port: %T %v, want a *pgconn.ConnectError", connectErr, connectErr)
		}
	}
	pg := func(code string) error { return &pgconn.PgError{Severity: "FATAL", Code: code, Message: "test"} }
	my := func(n uint16) error { return &mysql.MySQLError{Number: n, Message: "test"} }
	wrap := func(err error) error { return fmt.Errorf("outbox: publish to %q: %w", "t", err) }
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		// The drivers' own word.
		{"driver.ErrBadConn", driver.ErrBadConn, true},
		{"driver.ErrBadConn wrapped", wrap(driver.ErrBadConn), true},
		{"sql.ErrConnDone", sql.ErrConnDone, true},
		{"pgconn.ErrConnClosed", wrap(pgconn.ErrConnClosed), true},
		{"mysql.ErrInvalidConn", wrap(mysql.ErrInvalidConn), true},
		{"mysql.ErrInvalidConn joined", errors.Join(errors.New("other"), wrap(mysql.ErrInvalidConn)), true},
		{"another error of another text", errors.New("invalid connection string"), false},
		{"pgconn.ConnectError", connectErr, true},
		// PostgreSQL: the session ended.
		{"57P01 admin_shutdown", wrap(pg("57P01")), true},
		{"57P02 crash_shutdown", pg("57P02"), true},
		{"57P03 cannot_connect_now", pg("57P03"), true},
		{"08000 connection_exception", pg("08000"), true},
		{"08003 connection_does_not_exist", pg("08003"), true},
		{"08006 connection_failure", pg("08006"), true},
		// PostgreSQL: the statement's or the transaction's own.
		{"23505 unique_violation", pg("23505"), false},
		{"42601 syntax_error", pg("42601"), false},
		{"42P01 undefined_table", pg("42P01"), false},
		{"40001 serialization_failure", pg("40001"), false},
		{"40P01 deadlock_detected", pg("40P01"), false},
		{"55P03 lock_not_available", pg("55P03"), false},
		{"57014 query_canceled", pg("57014"), false},
		{"25P03 idle_in_transaction_session_timeout", pg("25P03"), false},
		{"25P02 in_failed_sql_transaction", pg("25P02"), false},
		// MySQL/MariaDB: the session ended.
		{"1053 server shutdown", my(1053), true},
		{"1927 connection killed", wrap(my(1927)), true},
		{"2006 server gone away", my(2006), true},
		{"2013 lost connection", my(2013), true},
		{"2055 lost connection", my(2055), true},
		// MySQL/MariaDB: the statement's own.
		{"1062 duplicate entry", my(1062), false},
		{"1064 syntax", my(1064), false},
		{"1146 no such table", my(1146), false},
		{"1205 lock wait timeout", my(1205), false},
		{"1213 deadlock", my(1213), false},
		{"4031 idle client disconnected", my(4031), false},
		// The network under a connection.
		{"net.OpError", wrap(refused.err), true},
		{"io.EOF", wrap(io.EOF), true},
		{"io.ErrUnexpectedEOF", io.ErrUnexpectedEOF, true},
		{"ECONNRESET", wrap(os.NewSyscallError("read", syscall.ECONNRESET)), true},
		{"EPIPE", wrap(os.NewSyscallError("write", syscall.EPIPE)), true},
		{"ETIMEDOUT", os.NewSyscallError("read", syscall.ETIMEDOUT), true},
		// settle's deadline on its own call.
		{"ErrCallTimeout", fmt.Errorf("%w: %w", ErrCallTimeout, context.Canceled), true},
		// Contexts and a handler's own errors.
		{"context.Canceled", context.Canceled, false},
		{"context.DeadlineExceeded", wrap(context.DeadlineExceeded), false},
		{"sql.ErrTxDone", sql.ErrTxDone, false},
		{"sql.ErrNoRows", sql.ErrNoRows, false},
		{"a handler's error", errors.New("card declined"), false},
		{"a permanent error", poison.Permanent(errors.New("bad payload")), false},
		{"dedupe.ErrClaimLost", dedupe.ErrClaimLost, false},
	}
	for _, c := range cases {
		if got := connTrouble(c.err); got != c.want {
			t.Errorf("%s: connTrouble(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

type refusedDial struct {
	addr string
	err  error // a *net.OpError, connection refused
}

// closedPortError dials a port that nothing listens on any more.
func closedPortError(t *testing.T) refusedDial {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	c, err := net.Dial("tcp", addr)
	if err == nil {
		_ = c.Close()
		t.Fatalf("dial %s: connected, want refused", addr)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) {
		t.Fatalf("dial %s: %T %v, want a *net.OpError", addr, err, err)
	}
	return refusedDial{addr: addr, err: err}
}

// A handler's error is its transaction's connection going away only when
// the connection is found dead too, and never when it ran out of settle's
// deadline on its call.
func TestHandlerLostConnection(t *testing.T) {
	t.Parallel()
	dead, alive := &probeTxn{err: driver.ErrBadConn}, &probeTxn{}
	netErr := closedPortError(t).err
	cases := []struct {
		name string
		tx   txn
		err  error
		want bool
	}{
		{"killed backend, dead connection", dead, &pgconn.PgError{Code: "57P01"}, true},
		{"bad connection, dead connection", dead, driver.ErrBadConn, true},
		{"a net error of the handler's own call, live connection", alive, netErr, false},
		{"io.EOF of the handler's own reading, live connection", alive, fmt.Errorf("read: %w", io.EOF), false},
		{"a statement's error, dead connection", dead, &pgconn.PgError{Code: "23505"}, false},
		{"settle's deadline on the handler's call, dead connection", dead, fmt.Errorf("%w: %w", ErrCallTimeout, context.Canceled), false},
		{"a handler's error", dead, errors.New("card declined"), false},
		{"probe past the deadline", &probeTxn{err: ErrCallTimeout}, driver.ErrBadConn, true},
	}
	for _, c := range cases {
		if got := handlerLostConnection(t.Context(), c.tx, c.err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// probeTxn is a txn whose probe returns err; its other methods are
// fakeTxn's.
type probeTxn struct {
	fakeTxn
	err error
}

func (t *probeTxn) probe(context.Context) error { return t.err }

// lossDB is a database whose transactions begin, and whose handler calls
// fail on a connection that went away (driver.ErrBadConn, found dead by the
// probe) for the first losses calls, forever when losses < 0.
type lossDB struct {
	mu      sync.Mutex
	losses  int
	calls   int
	begins  int
	handled []string
}

func (d *lossDB) begin(context.Context) (txn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.begins++
	return &lossTxn{d: d}, nil
}

type lossTxn struct {
	fakeTxn
	d    *lossDB
	lost bool
}

func (t *lossTxn) call(_ context.Context, msg *message.Message) error {
	t.d.mu.Lock()
	defer t.d.mu.Unlock()
	t.d.calls++
	if t.d.losses < 0 || t.d.calls <= t.d.losses {
		t.lost = true
		return fmt.Errorf("insert: %w", driver.ErrBadConn)
	}
	t.d.handled = append(t.d.handled, msg.UUID)
	return nil
}

func (t *lossTxn) probe(context.Context) error {
	if t.lost {
		return driver.ErrBadConn
	}
	return nil
}

func (t *lossTxn) callBatch(ctx context.Context, msgs []*message.Message) error {
	return t.call(ctx, msgs[0])
}

func (t *lossTxn) claims() claimer { return t }

// A transaction that keeps losing its connection is run again three times
// (four runs), a pause of BusyDelay before each, then deferred: never an
// attempt, and never a hot loop. Then, when the database recovers within the
// reruns, the delivery commits at once.
func TestLostConnectionIsRunAgainThenDeferred(t *testing.T) {
	t.Parallel()
	const delay = 20 * time.Millisecond
	for _, mode := range []string{"one_statement", "batch"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			run := func(d *lossDB) (*settlement.Record, time.Duration, error) {
				f := txFlow{begin: d.begin, oneStatement: true, busyDelay: delay, batch: BatchConfig{MaxSize: 2, MaxWait: -1}}
				ctx, rec := settlement.New(t.Context(), nil)
				msg := message.NewMessage("m-1", nil)
				msg.SetContext(ctx)
				start := time.Now()
				var err error
				if mode == "batch" {
					err = newBatcher(f).handle(msg)
				} else {
					err = runTx(ctx, f, msg)
				}
				return rec, time.Since(start), err
			}

			d := &lossDB{losses: -1}
			rec, took, err := run(d)
			if !errors.Is(err, ErrConnectionLost) || !errors.Is(err, dedupe.ErrUnavailable) || !errors.Is(err, driver.ErrBadConn) {
				t.Fatalf("err = %v; want one wrapping ErrConnectionLost, dedupe.ErrUnavailable and the driver's error", err)
			}
			if !rec.Deferred() {
				t.Fatal("the delivery was not deferred")
			}
			if d.calls != 1+connReruns || d.begins != 1+connReruns {
				t.Fatalf("%d calls in %d transactions, want %d of each", d.calls, d.begins, 1+connReruns)
			}
			// connReruns pauses, and the deferral's wait before the nack.
			if min := time.Duration(connReruns+1) * delay; took < min {
				t.Fatalf("the delivery took %v, want at least %v: a lost connection must not be a hot loop", took, min)
			}

			d = &lossDB{losses: connReruns}
			rec, _, err = run(d)
			if err != nil || rec.Deferred() || len(d.handled) != 1 {
				t.Fatalf("err = %v, deferred %v, handled %v; want the last rerun to commit", err, rec.Deferred(), d.handled)
			}
		})
	}
}
