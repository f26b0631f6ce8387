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

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

type env struct {
	db     testenv.DB
	ob     *outbox.Outbox
	pubsub *gochannel.GoChannel
	table  string // the test's business table
}

func setup(t testing.TB, db testenv.DB) *env {
	t.Helper()
	name := testenv.Name(t, "ob")
	topic := "ob_" + name[len(name)-8:]
	ob, err := outbox.New(outbox.Config{Dialect: db.Dialect, Topic: topic, Propagator: propagation.TraceContext{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context(), db.DB); err != nil {
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
	return &env{db: db, ob: ob, pubsub: ps, table: table}
}

func (e *env) ph(n int) string {
	if e.db.Dialect == sqldb.Postgres {
		return "$" + string(rune('0'+n))
	}
	return "?"
}

// placeOrder writes a business row and an outbox message in one
// transaction, and commits or rolls back.
func (e *env) placeOrder(t *testing.T, ctx context.Context, id string, commit bool, msgs ...*message.Message) {
	t.Helper()
	tx, err := e.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+e.table+" (id) VALUES ("+e.ph(1)+")", id); err != nil {
		t.Fatal(err)
	}
	pub, err := e.ob.TxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("orders.placed", msgs...); err != nil {
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

func forEachDB(t *testing.T, fn func(t *testing.T, e *env)) {
	t.Helper()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			fn(t, setup(t, d.Open(t)))
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
		st, err := e.ob.Status(t.Context(), e.db.DB)
		if err != nil || st.Pending != 0 {
			t.Fatalf("status after rollback = %+v, %v; want nothing pending", st, err)
		}
		n, err := e.ob.Forward(t.Context(), e.db.DB, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
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

		db := e.db.DB
		st, err := e.ob.Status(t.Context(), db)
		if err != nil || st.Pending != 2 {
			t.Fatalf("status before forwarding = %+v, %v; want 2 pending", st, err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		n, err := e.ob.Forward(t.Context(), db, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, MeterProvider: mp})
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
		n, err = e.ob.Forward(t.Context(), db, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
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
	e := setup(t, testenv.SQLite(t))
	e.placeOrder(t, t.Context(), "A-3", true, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	db := e.db.DB
	eventuallyLag := time.Now().Add(5 * time.Second)
	for {
		st, err := e.ob.Status(t.Context(), db)
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
	relay, err := e.ob.NewRelay(db, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, MeterProvider: mp})
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
	e := setup(t, testenv.SQLite(t))
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
	n, err := e.ob.Forward(t.Context(), e.db.DB, e.pubsub, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
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
		{outbox.Config{}, "Config.Dialect"},
		{outbox.Config{Dialect: sqldb.SQLite, Topic: "has space"}, "Config.Topic"},
		{outbox.Config{Dialect: sqldb.SQLite, Topic: `x"; DROP TABLE y`}, "Config.Topic"},
		{outbox.Config{Dialect: sqldb.SQLite, StuckAfter: -time.Second}, "Config.StuckAfter"},
	}
	for _, c := range cases {
		if _, err := outbox.New(c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("New(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
	ob, err := outbox.New(outbox.Config{Dialect: sqldb.SQLite})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.NewRelay(&sql.DB{}, gochannel.NewGoChannel(gochannel.Config{}, nil), outbox.RelayConfig{PollInterval: -1}); err == nil || !strings.Contains(err.Error(), "RelayConfig.PollInterval") {
		t.Errorf("NewRelay with a negative poll interval: %v", err)
	}
}
