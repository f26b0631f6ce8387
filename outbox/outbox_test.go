package outbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// The outbox's tests run on every driver of this table: database/sql on
// SQLite, PostgreSQL and MySQL/MariaDB (with and without clientFoundRows),
// and pgx on PostgreSQL. A test body sees the outbox through obx, which is
// the same whatever the driver's transaction type.
type drv struct {
	name string
	pgx  bool // the outbox runs on a pgx pool; db is a database/sql pool on the same PostgreSQL
	// open opens the database/sql pool of the test's own statements.
	open func(testing.TB) testenv.DB
}

func drivers() []drv {
	var ds []drv
	for _, d := range testenv.Databases() {
		ds = append(ds, drv{name: d.Name, open: d.Open})
	}
	return append(ds, pgxDrv)
}

var (
	sqliteDrv   = drv{name: "sqlite", open: testenv.SQLite}
	postgresDrv = drv{name: "postgres", open: testenv.Postgres}
	pgxDrv      = drv{name: "pgx", pgx: true, open: testenv.Postgres}
)

// postgresDrivers are the drivers on PostgreSQL: LISTEN/NOTIFY.
func postgresDrivers() []drv { return []drv{postgresDrv, pgxDrv} }

// api is what an Outbox does whatever its transaction type: every method
// but TxPublisher, which obx.begin binds.
type api interface {
	Check(context.Context) error
	Schema() []string
	SchemaUpgrade() []string
	InitSchema(context.Context) error
	Status(context.Context) (outbox.Status, error)
	Prune(context.Context, time.Time) (int64, error)
	Failed(context.Context, outbox.Selection) ([]outbox.FailedRow, error)
	Requeue(context.Context, outbox.Selection) (int64, error)
	Forward(context.Context, message.Publisher, outbox.RelayConfig) (int64, error)
	NewRelay(message.Publisher, outbox.RelayConfig) (*outbox.Relay, error)
	NewNotifier() (*outbox.Notifier, error)
	Notify()
	Topic() string
	Table() string
}

// obx is an outbox under test.
type obx struct {
	api
	cfg outbox.Config // as given to New
	// begin begins a transaction on the outbox's driver, with the outbox's
	// TxPublisher bound to it.
	begin func(ctx context.Context) (*ttx, error)
}

// ttx is a transaction of the driver under test.
type ttx struct {
	// Pub is the outbox's TxPublisher of the transaction.
	Pub      message.Publisher
	exec     func(ctx context.Context, q string, args ...any) error
	commit   func() error
	rollback func() error
}

func (x *ttx) Exec(ctx context.Context, q string, args ...any) error { return x.exec(ctx, q, args...) }
func (x *ttx) Commit() error                                         { return x.commit() }
func (x *ttx) Rollback() error                                       { return x.rollback() }

func wrap[TTx any](d sqldb.Driver[TTx], ob *outbox.Outbox[TTx]) *obx {
	return &obx{api: ob, begin: func(ctx context.Context) (*ttx, error) {
		tx, err := d.Begin(ctx, nil, "")
		if err != nil {
			return nil, err
		}
		pub, err := ob.TxPublisher(tx)
		if err != nil {
			_ = d.Rollback(ctx, tx)
			return nil, err
		}
		ex := d.Tx(tx)
		return &ttx{
			Pub: pub,
			exec: func(ctx context.Context, q string, args ...any) error {
				_, err := ex.Exec(ctx, q, args...)
				return err
			},
			commit:   func() error { return d.Commit(context.Background(), tx) },
			rollback: func() error { return d.Rollback(context.Background(), tx) },
		}, nil
	}}
}

// outboxOn returns a maker of outboxes on d: on db's pool, or for pgx on a
// pgx pool of its own to db's PostgreSQL.
func outboxOn(t testing.TB, d drv, db testenv.DB) func(outbox.Config) (*obx, error) {
	if d.pgx {
		pool := testenv.PgxPool(t)
		drv := sqldb.Pgx(pool)
		return func(cfg outbox.Config) (*obx, error) {
			ob, err := outbox.New(drv, cfg)
			if err != nil {
				return nil, err
			}
			x := wrap(drv, ob)
			x.cfg = cfg
			return x, nil
		}
	}
	drv := sqldb.Std(db.DB, sqldb.Dialect(db.Dialect))
	return func(cfg outbox.Config) (*obx, error) {
		ob, err := outbox.New(drv, cfg)
		if err != nil {
			return nil, err
		}
		x := wrap(drv, ob)
		x.cfg = cfg
		return x, nil
	}
}

type env struct {
	d  drv
	db testenv.DB // the test's own statements
	ob *obx
	// newOutbox makes another outbox on the driver and pool of ob.
	newOutbox func(outbox.Config) (*obx, error)
	pubsub    *gochannel.GoChannel
	table     string // the test's business table
}

// another returns an outbox of cfg on the driver of e, on the same pool.
func (e *env) another(t testing.TB, cfg outbox.Config) *obx {
	t.Helper()
	ob, err := e.newOutbox(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return ob
}

// elsewhere returns an outbox of cfg on the driver of e, on a pool of its
// own (as in another process; on SQLite, one file, the same pool).
func (e *env) elsewhere(t testing.TB, cfg outbox.Config) *obx {
	t.Helper()
	db := e.db
	if db.Dialect != sqldb.SQLite {
		db = e.d.open(t)
	}
	ob, err := outboxOn(t, e.d, db)(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return ob
}

func setup(t testing.TB, d drv) *env {
	t.Helper()
	db := d.open(t)
	name := testenv.Name(t, "ob")
	topic := "ob_" + name[len(name)-8:]
	mk := outboxOn(t, d, db)
	ob, err := mk(outbox.Config{Topic: topic, Tracing: []settle.Option{settle.WithPropagators(propagation.TraceContext{})}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	table := testenv.Name(t, "biz")
	if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+table+" (id VARCHAR(64) PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		_, _ = db.ExecContext(ctx, "DROP TABLE "+table)
		q := func(s string) string {
			if db.Dialect == sqldb.MySQL {
				return "`" + s + "`"
			}
			return `"` + s + `"`
		}
		_, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+q(topic))
		_, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+q(topic+"_relays"))
	})
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	return &env{d: d, db: db, ob: ob, newOutbox: mk, pubsub: ps, table: table}
}

func (e *env) ph(n int) string {
	if e.db.Dialect == sqldb.Postgres {
		return "$" + string(rune('0'+n))
	}
	return "?"
}

// begin begins a transaction of the driver under test with the outbox's
// publisher bound to it.
func (e *env) begin(t testing.TB, ctx context.Context) *ttx {
	t.Helper()
	tx, err := e.ob.begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// placeOrder writes a business row and an outbox message in one
// transaction, and commits or rolls back.
func (e *env) placeOrder(t *testing.T, ctx context.Context, id string, commit bool, msgs ...*message.Message) {
	t.Helper()
	tx := e.begin(t, ctx)
	defer func() { _ = tx.Rollback() }()
	if err := tx.Exec(ctx, "INSERT INTO "+e.table+" (id) VALUES ("+e.ph(1)+")", id); err != nil {
		t.Fatal(err)
	}
	if err := tx.Pub.Publish("orders.placed", msgs...); err != nil {
		t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
}

// rawInsert writes a row into the outbox table as something other than
// settle would.
func (e *env) rawInsert(t testing.TB, uuid, topic string, payload []byte, metadata string) {
	t.Helper()
	q := "INSERT INTO " + quoteTable(e, e.ob.Table()) + " (uuid, topic, payload, metadata) VALUES (" + e.ph(1) + ", " + e.ph(2) + ", " + e.ph(3) + ", " + e.ph(4) + ")"
	if _, err := e.db.ExecContext(t.Context(), q, uuid, topic, payload, metadata); err != nil {
		t.Fatal(err)
	}
}

func (e *env) count(t *testing.T) int {
	t.Helper()
	var n int
	if err := e.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+e.table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// forEachDB runs fn on every driver.
func forEachDB(t *testing.T, fn func(t *testing.T, e *env)) {
	t.Helper()
	forEach(t, drivers(), fn)
}

// forEach runs fn on each of ds, in parallel.
func forEach(t *testing.T, ds []drv, fn func(t *testing.T, e *env)) {
	t.Helper()
	for _, d := range ds {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			fn(t, setup(t, d))
		})
	}
}

func TestRollbackLeavesNoMessage(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		e.placeOrder(t, t.Context(), "A-1", false, message.NewMessage(watermill.NewUUID(), []byte(`{"id":"A-1"}`)))
		if n := e.count(t); n != 0 {
			t.Fatalf("%d business rows after rollback", n)
		}
		st, err := e.ob.Status(t.Context())
		if err != nil || st.Pending != 0 {
			t.Fatalf("status after rollback = %+v, %v; want nothing pending", st, err)
		}
		n, err := e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil || n != 0 {
			t.Fatalf("Forward = %d, %v; want 0 forwarded", n, err)
		}
	})
}

func TestCommitForwardsOnceWithTraceContext(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		out, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
		if err != nil {
			t.Fatal(err)
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
		ctx, span := tp.Tracer("test").Start(t.Context(), "place order")
		longUUID := "order-" + strings.Repeat("x", 200) // does not fit watermill-sql's 36-character column
		msg := message.NewMessage(longUUID, []byte(`{"id":"A-2"}`))
		msg.Metadata.Set("tenant", "acme")
		msg.SetContext(ctx)
		e.placeOrder(t, ctx, "A-2", true, msg, message.NewMessage(watermill.NewUUID(), []byte(`{"id":"A-2","line":2}`)))
		span.End()

		st, err := e.ob.Status(t.Context())
		if err != nil || st.Pending != 2 {
			t.Fatalf("status before forwarding = %+v, %v; want 2 pending", st, err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		n, err := e.metered(t, mp).Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil || n != 2 {
			t.Fatalf("Forward = %d, %v; want 2", n, err)
		}
		// GoChannel hands the two messages over in no particular order.
		got, second := <-out, <-out
		got.Ack()
		second.Ack()
		if got.UUID != longUUID {
			got, second = second, got
		}
		if got.UUID != longUUID || string(got.Payload) != `{"id":"A-2"}` || got.Metadata.Get("tenant") != "acme" {
			t.Fatalf("forwarded message = %s %q %v; want the original", got.UUID, got.Payload, got.Metadata)
		}
		sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagationCarrier(got.Metadata)))
		if sc.TraceID() != span.SpanContext().TraceID() {
			t.Fatalf("trace %s after the outbox, want %s (traceparent %q)", sc.TraceID(), span.SpanContext().TraceID(), got.Metadata.Get("traceparent"))
		}
		if second.UUID == longUUID {
			t.Fatal("the same message arrived twice")
		}
		// A second run finds nothing: each row is forwarded once.
		n, err = e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
		if err != nil || n != 0 {
			t.Fatalf("second Forward = %d, %v; want 0", n, err)
		}
		select {
		case m := <-out:
			t.Fatalf("message %s forwarded twice", m.UUID)
		default:
		}
		_ = mp.Shutdown(context.Background())
	})
}

type propagationCarrier message.Metadata

func (c propagationCarrier) Get(k string) string { return c[k] }
func (c propagationCarrier) Set(k, v string)     { c[k] = v }
func (c propagationCarrier) Keys() []string {
	var ks []string
	for k := range c {
		ks = append(ks, k)
	}
	return ks
}

func TestRelayMetricsAndLag(t *testing.T) {
	t.Parallel()
	e := setup(t, sqliteDrv)
	e.placeOrder(t, t.Context(), "A-3", true, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	eventuallyLag := time.Now().Add(5 * time.Second)
	for {
		st, err := e.ob.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 1 && st.Lag > 0 {
			break
		}
		if time.Now().After(eventuallyLag) {
			t.Fatalf("status %+v never showed a lag", st)
		}
		time.Sleep(5 * time.Millisecond)
	}

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	relay, err := e.metered(t, mp).NewRelay(e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	if v := gauge(t, rm, "settle.outbox.pending"); v != 1 {
		t.Fatalf("pending gauge = %v before forwarding, want 1", v)
	}
	done := make(chan error, 1)
	go func() { done <- relay.Run(context.Background()) }()
	<-relay.Running()
	if err := relay.Drain(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := relay.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	if v := sum(t, rm, "settle.outbox.forwarded"); v != 1 {
		t.Fatalf("forwarded counter = %d, want 1", v)
	}
}

func gauge(t *testing.T, rm metricdata.ResourceMetrics, name string) float64 {
	t.Helper()
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch d := m.Data.(type) {
			case metricdata.Gauge[int64]:
				return float64(d.DataPoints[0].Value)
			case metricdata.Gauge[float64]:
				return d.DataPoints[0].Value
			}
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

func sum(t *testing.T, rm metricdata.ResourceMetrics, name string) int64 {
	t.Helper()
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
				return d.DataPoints[0].Value
			}
		}
	}
	t.Fatalf("no counter %s", name)
	return 0
}

func TestForeignRowGoesToPoisonTopic(t *testing.T) {
	t.Parallel()
	e := setup(t, sqliteDrv)
	poisoned, err := e.pubsub.Subscribe(t.Context(), e.ob.Topic()+"_poison")
	if err != nil {
		t.Fatal(err)
	}
	// Something other than settle writes a row into the outbox table.
	e.rawInsert(t, watermill.NewUUID(), "orders.placed", []byte("not an envelope"), "not json")
	e.placeOrder(t, t.Context(), "A-4", true, message.NewMessage("after-the-foreign-row", []byte(`{}`)))
	placed, err := e.pubsub.Subscribe(t.Context(), "orders.placed")
	if err != nil {
		t.Fatal(err)
	}
	n, err := e.ob.Forward(t.Context(), e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	if err != nil || n != 1 {
		t.Fatalf("Forward = %d, %v; want the one settle row forwarded", n, err)
	}
	if m := <-poisoned; string(m.Payload) != "not an envelope" {
		t.Fatalf("poison topic got %q", m.Payload)
	}
	if m := <-placed; m.UUID != "after-the-foreign-row" {
		t.Fatalf("placed got %s", m.UUID)
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	cases := []struct {
		cfg   outbox.Config
		field string
	}{
		{outbox.Config{Topic: "has space"}, "Config.Topic"},
		{outbox.Config{Topic: `x"; DROP TABLE y`}, "Config.Topic"},
		{outbox.Config{StuckAfter: -time.Second}, "Config.StuckAfter"},
	}
	db := sqldb.Std(&sql.DB{}, sqldb.SQLite)
	for _, c := range cases {
		if _, err := outbox.New(db, c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("New(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
	if _, err := outbox.New(sqldb.Std(&sql.DB{}, "oracle"), outbox.Config{}); err == nil || !strings.Contains(err.Error(), "oracle") {
		t.Errorf("New on an unknown dialect = %v; want an error naming it", err)
	}
	if _, err := outbox.New[*sql.Tx](nil, outbox.Config{}); err == nil {
		t.Error("New on a nil driver: no error")
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.NewRelay(gochannel.NewGoChannel(gochannel.Config{}, nil), outbox.RelayConfig{PollInterval: -1}); err == nil || !strings.Contains(err.Error(), "RelayConfig.PollInterval") {
		t.Errorf("NewRelay with a negative poll interval: %v", err)
	}
}
