package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// telemetry is the example's OpenTelemetry setup: traces go to an OTLP
// endpoint when the standard OTEL_EXPORTER_OTLP_* variables name one, and
// the settlement metrics are read in process for the final table.
type telemetry struct {
	tp       *sdktrace.TracerProvider
	mp       *sdkmetric.MeterProvider
	reader   *sdkmetric.ManualReader
	exporter *watchedExporter // nil when traces are not exported
	warn     io.Writer
}

// newTelemetry sets up the providers and says on out where the traces go.
func newTelemetry(ctx context.Context, out, warn io.Writer) (*telemetry, error) {
	name := os.Getenv("OTEL_SERVICE_NAME")
	if name == "" {
		name = "settle-orders"
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(name)))
	if err != nil {
		return nil, err
	}
	t := &telemetry{reader: sdkmetric.NewManualReader(), warn: warn}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if endpoint := otlpEndpoint(); endpoint != "" {
		// Configured by the OTEL_EXPORTER_OTLP_* variables; retries are
		// kept short so that an endpoint with nothing behind it is
		// reported within seconds, not after the exporter's minute.
		exp, err := otlptracehttp.New(ctx, otlptracehttp.WithRetry(otlptracehttp.RetryConfig{
			Enabled: true, InitialInterval: 100 * time.Millisecond, MaxInterval: time.Second, MaxElapsedTime: 3 * time.Second,
		}))
		if err != nil {
			return nil, fmt.Errorf("OTLP exporter: %w", err)
		}
		t.exporter = &watchedExporter{SpanExporter: exp, endpoint: endpoint, warn: warn}
		opts = append(opts, sdktrace.WithBatcher(t.exporter, sdktrace.WithBatchTimeout(200*time.Millisecond)))
		fmt.Fprintf(out, "traces: exported over OTLP/HTTP to %s as service %q\n", endpoint, name)
	} else {
		fmt.Fprintf(out, "traces: not exported; set OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 to send them to a local Jaeger (docs/tracing.md)\n")
	}
	t.tp = sdktrace.NewTracerProvider(opts...)
	t.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(t.reader), sdkmetric.WithResource(res))
	return t, nil
}

// otlpEndpoint is where the OTLP/HTTP exporter sends traces by the
// standard variables, or "" when they name none.
func otlpEndpoint() string {
	if e := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"); e != "" {
		return e
	}
	if e := os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT"); e != "" {
		return strings.TrimRight(e, "/") + "/v1/traces"
	}
	return ""
}

// watchedExporter counts what its exporter sent and failed to send, and
// warns at the first failure: an exporter on its own drops spans silently.
type watchedExporter struct {
	sdktrace.SpanExporter
	endpoint string
	warn     io.Writer

	mu               sync.Mutex
	exported, failed int
}

func (w *watchedExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := w.SpanExporter.ExportSpans(ctx, spans)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		if w.failed == 0 {
			fmt.Fprintf(w.warn, "orders: warning: exporting traces to %s failed: %v\n", w.endpoint, err)
		}
		w.failed += len(spans)
		// Counted and reported here: returning the error would only have
		// the batch processor log it again, batch after batch.
		return nil
	}
	w.exported += len(spans)
	return nil
}

func (t *telemetry) outcomes(ctx context.Context) (outcomeCounts, error) {
	return readOutcomes(ctx, t.reader)
}

// shutdown flushes the spans still batched and says how many spans could
// not be exported.
func (t *telemetry) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := t.tp.Shutdown(ctx)
	_ = t.mp.Shutdown(ctx)
	if w := t.exporter; w != nil {
		w.mu.Lock()
		defer w.mu.Unlock()
		switch {
		case w.failed > 0:
			fmt.Fprintf(t.warn, "orders: warning: %d spans were not exported to %s (%d were)\n", w.failed, w.endpoint, w.exported)
		case err != nil:
			fmt.Fprintf(t.warn, "orders: warning: flushing the last traces to %s: %v\n", w.endpoint, err)
		}
	}
}

// newRunID returns the ID that names a run's tables and queues: "r", the
// start time in seconds (base 36) and 4 random hex digits, so that a later
// run can tell how old leftovers are.
func newRunID(now time.Time) string {
	var b [2]byte
	_, _ = rand.Read(b[:])
	return "r" + strconv.FormatInt(now.Unix(), 36) + hex.EncodeToString(b[:])
}

// runIDPattern matches a run ID; runStart returns the time it was made.
const runIDPattern = `r[0-9a-z]{6,}[0-9a-f]{4}`

func runStart(id string) (time.Time, bool) {
	if len(id) < 11 || id[0] != 'r' {
		return time.Time{}, false
	}
	secs, err := strconv.ParseInt(id[1:len(id)-4], 36, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(secs, 0), true
}

// tableNames are the tables of a run: its own and its outbox's.
func tableNames(runID string) []string {
	return []string{
		"orders_claims_" + runID, "orders_" + runID, "orders_charges_" + runID, "orders_emails_" + runID,
		"orders_outbox_" + runID, "orders_outbox_" + runID + "_relays",
		"orders_parked_" + runID, "orders_parked_" + runID + "_groups",
	}
}

var leftoverTable = regexp.MustCompile(`^(?:orders|orders_claims|orders_charges|orders_emails|orders_outbox|orders_parked)_(` + runIDPattern + `)(?:_relays|_groups)?$`)

// leftovers are the tables and queues (or streams) earlier runs did not
// remove.
type leftovers struct {
	runs           []string
	tables, queues []string
}

// removeLeftovers drops the tables of earlier runs that started more than
// minAge ago, and their queues or streams on the broker of spec. Younger
// ones may belong to a run still going on.
func removeLeftovers(ctx context.Context, db *sql.DB, d sqldb.Dialect, spec brokerSpec, now time.Time, minAge time.Duration) (leftovers, error) {
	var q string
	switch d {
	case sqldb.Postgres:
		q = "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
	case sqldb.MySQL:
		q = "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()"
	default:
		q = "SELECT name FROM sqlite_master WHERE type = 'table'"
	}
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return leftovers{}, fmt.Errorf("listing tables: %w", err)
	}
	var l leftovers
	seen := map[string]bool{}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			_ = rows.Close()
			return leftovers{}, err
		}
		m := leftoverTable.FindStringSubmatch(name)
		if m == nil {
			// watermill-sql's tables of a run on -broker sql
			m = sqlBrokerTable.FindStringSubmatch(name)
		}
		if m == nil {
			continue
		}
		if start, ok := runStart(m[1]); !ok || now.Sub(start) < minAge {
			continue
		}
		l.tables = append(l.tables, name)
		if !seen[m[1]] {
			seen[m[1]] = true
			l.runs = append(l.runs, m[1])
		}
	}
	_ = rows.Close()
	if err := rows.Err(); err != nil {
		return leftovers{}, err
	}
	sort.Strings(l.runs)
	sort.Strings(l.tables)
	for _, t := range l.tables {
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t); err != nil {
			return l, fmt.Errorf("dropping %s: %w", t, err)
		}
	}
	if spec.Kind != brokerGoChannel && spec.Kind != brokerSQL {
		for _, id := range l.runs {
			l.queues = append(l.queues, newTopicNames(id).all...)
			removeRun(ctx, spec, id)
		}
	}
	return l, nil
}

// schema holds the run's table names: fresh ones per run, dropped at the end.
type schema struct {
	db          *sql.DB
	dialect     sqldb.Dialect
	claims      string
	orders      string
	charges     string
	emails      string
	parked      string // the parked-message store's table (and its _groups)
	outboxTopic string
}

func newSchema(ctx context.Context, db *sql.DB, d sqldb.Dialect, runID string) (*schema, error) {
	t := tableNames(runID)
	s := &schema{
		db: db, dialect: d,
		claims:      t[0],
		orders:      t[1],
		charges:     t[2],
		emails:      t[3],
		parked:      t[6],
		outboxTopic: "orders_outbox_" + runID,
	}
	// A real service runs these in its migrations.
	claims, err := dedupe.NewSQLStore(sqldb.Std(db, d), dedupe.SQLConfig{Table: s.claims})
	if err != nil {
		return nil, err
	}
	parkedStore, err := parked.New(sqldb.Std(db, d), parked.Config{Table: s.parked})
	if err != nil {
		return nil, err
	}
	ddl := append(claims.Schema(), parkedStore.Schema()...)
	ddl = append(ddl,
		"CREATE TABLE "+s.orders+" (id VARCHAR(64) PRIMARY KEY, cents INTEGER NOT NULL)",
		"CREATE TABLE "+s.charges+" (order_id VARCHAR(64) PRIMARY KEY, cents INTEGER NOT NULL)",
		"CREATE TABLE "+s.emails+" (order_id VARCHAR(64) PRIMARY KEY)",
	)
	for _, stmt := range ddl {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			s.drop()
			return nil, fmt.Errorf("schema: %w", err)
		}
	}
	return s, nil
}

func (s *schema) ph(n int) string {
	if s.dialect == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func (s *schema) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The parked table and its group counts, in either order of their
	// dependency.
	for _, t := range []string{s.claims, s.orders, s.charges, s.emails, s.parked + "_groups", s.parked, s.parked + "_groups"} {
		_, _ = s.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t)
	}
}

func (s *schema) dropOutbox(table string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q := `"`
	if s.dialect == sqldb.MySQL {
		q = "`"
	}
	for _, t := range []string{table, table + "_relays"} {
		_, _ = s.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+q+t+q)
	}
}
