package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// pgxEnv is an outbox on PostgreSQL reached only through pgx: a pool, the
// caller's own pgx.Tx, no database/sql anywhere.
type pgxEnv struct {
	pool   *pgxpool.Pool
	ob     *outbox.Outbox
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	pubsub *gochannel.GoChannel
	table  string // the test's business table
}

func pgxSetup(t *testing.T, cfg outbox.Config) *pgxEnv {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	t.Cleanup(func() {
		// After the relays stopped: their LISTEN connections are closed,
		// none is left acquired. (A connection whose statement was
		// interrupted by the stop is destroyed by pgxpool asynchronously.)
		deadline := time.Now().Add(5 * time.Second)
		for n := pool.Stat().AcquiredConns(); n != 0; n = pool.Stat().AcquiredConns() {
			if time.Now().After(deadline) {
				t.Errorf("%d pool connection(s) still acquired after the test", n)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	name := testenv.Name(t, "ob")
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg.Dialect = sqldb.Postgres
	cfg.Topic = "ob_" + name[len(name)-8:]
	cfg.Propagator = propagation.TraceContext{}
	cfg.TracerProvider = tp
	ob, err := outbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.PgxInitSchema(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	table := testenv.Name(t, "biz")
	if _, err := pool.Exec(t.Context(), "CREATE TABLE "+table+" (id TEXT PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		for _, q := range []string{"DROP TABLE " + table, `DROP TABLE IF EXISTS "` + ob.Table() + `"`, `DROP TABLE IF EXISTS "` + ob.Table() + `_relays"`} {
			_, _ = pool.Exec(ctx, q)
		}
	})
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	return &pgxEnv{pool: pool, ob: ob, spans: spans, tp: tp, pubsub: ps, table: table}
}

// placeOrder writes a business row and the messages in one pgx transaction
// of its own and commits it, or rolls it back after checking that the
// transaction itself sees its outbox rows.
func (e *pgxEnv) placeOrder(t *testing.T, ctx context.Context, id string, commit bool, msgs ...*message.Message) {
	t.Helper()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+e.table+" (id) VALUES ($1)", id); err != nil {
		t.Fatal(err)
	}
	pub, err := e.ob.PgxTxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("orders.placed", msgs...); err != nil {
		t.Fatal(err)
	}
	if !commit {
		// The rows are in the caller's transaction: it sees them, and
		// nobody else does.
		var inTx, outside int
		q := `SELECT COUNT(*) FROM "` + e.ob.Table() + `" WHERE uuid = $1`
		if err := tx.QueryRow(ctx, q, msgs[0].UUID).Scan(&inTx); err != nil {
			t.Fatal(err)
		}
		if err := e.pool.QueryRow(ctx, q, msgs[0].UUID).Scan(&outside); err != nil {
			t.Fatal(err)
		}
		if inTx != 1 || outside != 0 {
			t.Fatalf("before the rollback: %d outbox row(s) in the transaction, %d outside it; want 1 and 0 (the publisher must write on the caller's pgx.Tx)", inTx, outside)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func (e *pgxEnv) count(t *testing.T, q string) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(t.Context(), q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// startPgxRelay runs a pgx relay until the test ends.
func (e *pgxEnv) startPgxRelay(t *testing.T, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	r, err := e.ob.NewPgxRelay(e.pool, e.pubsub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return runUntilEnd(t, r, func(err error) {
		if err != nil {
			t.Error(err)
		}
	})
}

// A committed pgx transaction's messages are forwarded by the pgx relay,
// each once, with the trace of the code that published them; Status, Check
// and Prune answer through the pool.
func TestPgxCommitForwardedOnce(t *testing.T) {
	t.Parallel()
	e := pgxSetup(t, outbox.Config{})
	if err := e.ob.PgxCheck(t.Context(), e.pool); err != nil {
		t.Fatalf("PgxCheck after PgxInitSchema: %v", err)
	}
	out, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	ctx, span := e.tp.Tracer("test").Start(t.Context(), "place order")
	first := message.NewMessage("order:P-1:placed", []byte(`{"id":"P-1"}`))
	first.Metadata.Set("tenant", "acme")
	second := message.NewMessage(watermill.NewUUID(), []byte(`{"id":"P-1","line":2}`))
	for _, m := range []*message.Message{first, second} {
		m.SetContext(ctx)
	}
	e.placeOrder(t, ctx, "P-1", true, first, second)
	span.End()

	st, err := e.ob.PgxStatus(t.Context(), e.pool)
	if err != nil || st.Pending != 2 {
		t.Fatalf("PgxStatus before forwarding = %+v, %v; want 2 pending", st, err)
	}
	r := e.startPgxRelay(t, outbox.RelayConfig{PollInterval: time.Hour})
	got := map[string]*message.Message{}
	for range 2 {
		select {
		case m := <-out:
			m.Ack()
			if got[m.UUID] != nil {
				t.Fatalf("%s forwarded twice", m.UUID)
			}
			got[m.UUID] = m
		case <-time.After(10 * time.Second):
			t.Fatalf("forwarded %d of 2 messages", len(got))
		}
	}
	dctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := r.Drain(dctx); err != nil {
		t.Fatal(err)
	}
	m := got[first.UUID]
	if m == nil || got[second.UUID] == nil {
		t.Fatalf("forwarded %v; want %s and %s", keys(got), first.UUID, second.UUID)
	}
	if string(m.Payload) != `{"id":"P-1"}` || m.Metadata.Get("tenant") != "acme" {
		t.Fatalf("forwarded %q %v; want the original", m.Payload, m.Metadata)
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagationCarrier(m.Metadata)))
	if sc.TraceID() != span.SpanContext().TraceID() {
		t.Fatalf("trace %s after the outbox, want %s", sc.TraceID(), span.SpanContext().TraceID())
	}
	// One create span per message, children of the publishing code's span,
	// and one send span each, children of the create spans.
	creates := map[trace.SpanID]bool{}
	var sends int
	for _, s := range e.spans.Ended() {
		switch s.Name() {
		case "create orders.placed":
			if s.Parent().SpanID() != span.SpanContext().SpanID() || s.SpanKind() != trace.SpanKindProducer {
				t.Errorf("create span: parent %s kind %s; want the request span, producer", s.Parent().SpanID(), s.SpanKind())
			}
			creates[s.SpanContext().SpanID()] = true
		case "send orders.placed":
			sends++
		}
	}
	for _, s := range e.spans.Ended() {
		if s.Name() == "send orders.placed" && !creates[s.Parent().SpanID()] {
			t.Errorf("send span's parent %s is no create span", s.Parent().SpanID())
		}
	}
	if len(creates) != 2 || sends != 2 {
		t.Fatalf("%d create and %d send spans, want 2 and 2", len(creates), sends)
	}
	// Drain returns once the marks are committed on the server; the relay
	// counts them when its Commit call returns, a moment later.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		fwd, failed := r.Counts()
		if fwd == 2 && failed == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Counts = %d forwarded, %d failed; want 2 and 0", fwd, failed)
		}
	}
	// Once: a second relay on the pool finds nothing.
	n, err := e.ob.PgxForward(t.Context(), e.pool, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil || n != 0 {
		t.Fatalf("PgxForward after the relay = %d, %v; want 0", n, err)
	}
	select {
	case m := <-out:
		t.Fatalf("%s forwarded twice", m.UUID)
	case <-time.After(100 * time.Millisecond):
	}
	if n, err := e.ob.PgxPrune(t.Context(), e.pool, 0); err != nil || n != 2 {
		t.Fatalf("PgxPrune = %d, %v; want the 2 forwarded rows deleted", n, err)
	}
}

func keys(m map[string]*message.Message) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// A rollback of the caller's own pgx.Tx leaves no outbox row (and no
// business row), and nothing is forwarded.
func TestPgxRollbackLeavesNoOutboxRow(t *testing.T) {
	t.Parallel()
	e := pgxSetup(t, outbox.Config{})
	e.placeOrder(t, t.Context(), "R-1", false, message.NewMessage("rolled-back", []byte(`{"id":"R-1"}`)))
	if n := e.count(t, `SELECT COUNT(*) FROM "`+e.ob.Table()+`"`); n != 0 {
		t.Fatalf("%d outbox row(s) after the rollback, want 0", n)
	}
	if n := e.count(t, "SELECT COUNT(*) FROM "+e.table); n != 0 {
		t.Fatalf("%d business row(s) after the rollback, want 0", n)
	}
	n, err := e.ob.PgxForward(t.Context(), e.pool, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil || n != 0 {
		t.Fatalf("PgxForward after the rollback = %d, %v; want 0", n, err)
	}
}

// A transaction that writes first and commits last is forwarded at its
// commit, through NOTIFY alone: the relay's fallback poll is an hour and
// nobody calls Notify.
func TestPgxLateCommitForwardedOnNotify(t *testing.T) {
	t.Parallel()
	e := pgxSetup(t, outbox.Config{})
	got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	e.startPgxRelay(t, outbox.RelayConfig{PollInterval: time.Hour})
	receive := func(want string) {
		t.Helper()
		select {
		case m := <-got:
			m.Ack()
			if m.UUID != want {
				t.Fatalf("got %s, want %s", m.UUID, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s was not forwarded on commit", want)
		}
	}
	early, err := e.pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = early.Rollback(context.Background()) }()
	pub, err := e.ob.PgxTxPublisher(early)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("orders.placed", message.NewMessage("early", []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	e.placeOrder(t, t.Context(), "L-1", true, message.NewMessage("late", []byte(`{}`)))
	receive("late")
	if err := early.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	receive("early")
}

// Writers on separate pool connections commit (90%) or roll back (10%)
// transactions of 1-3 messages after random delays, while two pgx relays
// that poll once an hour forward on NOTIFY: every committed message arrives
// exactly once, no rolled-back one.
func TestPgxConcurrentWritersTwoRelays(t *testing.T) {
	t.Parallel()
	e := pgxSetup(t, outbox.Config{})
	got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	e.startPgxRelay(t, outbox.RelayConfig{PollInterval: time.Hour, BatchSize: 7})
	e.startPgxRelay(t, outbox.RelayConfig{PollInterval: time.Hour, BatchSize: 7})
	const writers, txs = 4, 25
	var (
		mu        sync.Mutex
		committed = map[string]bool{}
	)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range txs {
				commit := rand.IntN(10) != 0
				var msgs []*message.Message
				for k := range 1 + rand.IntN(3) {
					msgs = append(msgs, message.NewMessage(fmt.Sprintf("w%d-t%d-m%d", w, i, k), []byte(`{}`)))
				}
				if err := e.writeTx(t.Context(), fmt.Sprintf("w%d-t%d", w, i), commit, time.Duration(rand.IntN(20))*time.Millisecond, msgs); err != nil {
					t.Error(err)
					return
				}
				if commit {
					mu.Lock()
					for _, m := range msgs {
						committed[m.UUID] = true
					}
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	seen := map[string]bool{}
	for len(seen) < len(committed) {
		select {
		case m := <-got:
			m.Ack()
			if !committed[m.UUID] {
				t.Fatalf("%s forwarded, but its transaction rolled back", m.UUID)
			}
			if seen[m.UUID] {
				t.Fatalf("%s forwarded twice", m.UUID)
			}
			seen[m.UUID] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d committed messages forwarded", len(seen), len(committed))
		}
	}
	select {
	case m := <-got:
		t.Fatalf("%s forwarded after all committed ones (again?)", m.UUID)
	case <-time.After(200 * time.Millisecond):
	}
}

// writeTx is placeOrder for writers that report instead of failing.
func (e *pgxEnv) writeTx(ctx context.Context, id string, commit bool, delay time.Duration, msgs []*message.Message) error {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+e.table+" (id) VALUES ($1)", id); err != nil {
		return err
	}
	pub, err := e.ob.PgxTxPublisher(tx)
	if err != nil {
		return err
	}
	if err := pub.Publish("orders.placed", msgs...); err != nil {
		return err
	}
	time.Sleep(delay)
	if !commit {
		return tx.Rollback(ctx)
	}
	return tx.Commit(ctx)
}

// The pgx functions are PostgreSQL only and say so.
func TestPgxRefusesOtherDialects(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(t.Context(), testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ob, err := outbox.New(outbox.Config{Dialect: sqldb.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer func() { _ = ps.Close() }()
	_, perr := ob.PgxTxPublisher(tx)
	_, rerr := ob.NewPgxRelay(pool, ps, outbox.RelayConfig{})
	_, serr := ob.PgxStatus(t.Context(), pool)
	for _, err := range []error{perr, rerr, serr, ob.PgxCheck(t.Context(), pool)} {
		if err == nil || !strings.Contains(err.Error(), "PostgreSQL only") {
			t.Errorf("pgx function on a mysql outbox: %v; want an error saying PostgreSQL only", err)
		}
	}
	pg, err := outbox.New(outbox.Config{Dialect: sqldb.Postgres})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pg.PgxTxPublisher(nil); err == nil {
		t.Error("PgxTxPublisher(nil) = nil error; want one")
	}
}

// On a pool of one connection the relay does not LISTEN (that would hold
// the only connection for good and starve its batches): it polls, and
// forwards.
func TestPgxRelayOnOneConnectionPolls(t *testing.T) {
	t.Parallel()
	e := pgxSetup(t, outbox.Config{})
	cfg, err := pgxpool.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(one.Close)
	got, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	r, err := e.ob.NewPgxRelay(one, e.pubsub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, AckDeadline: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		_ = r.Close()
	})
	select {
	case <-r.Running():
	case <-time.After(5 * time.Second):
		t.Fatal("a relay on a one-connection pool did not start (its LISTEN holds the only connection?)")
	}
	e.placeOrder(t, t.Context(), "C-1", true, message.NewMessage("one-conn", []byte(`{}`)))
	select {
	case m := <-got:
		m.Ack()
		if m.UUID != "one-conn" {
			t.Fatalf("got %s", m.UUID)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a relay on a one-connection pool forwarded nothing")
	}
}
