package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/outbox"
)

// telemetry is the example's OpenTelemetry setup: traces go to an OTLP
// endpoint when the standard OTEL_EXPORTER_OTLP_* variables name one, and
// the settlement metrics are read in process for the final table.
type telemetry struct {
	tp     *sdktrace.TracerProvider
	mp     *sdkmetric.MeterProvider
	reader *sdkmetric.ManualReader
}

func newTelemetry(ctx context.Context) (*telemetry, error) {
	name := os.Getenv("OTEL_SERVICE_NAME")
	if name == "" {
		name = "settle-orders"
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(name)))
	if err != nil {
		return nil, err
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" {
		exp, err := otlptracehttp.New(ctx) // configured by the OTEL_EXPORTER_OTLP_* variables
		if err != nil {
			return nil, fmt.Errorf("OTLP exporter: %w", err)
		}
		opts = append(opts, sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(200*time.Millisecond)))
	}
	reader := sdkmetric.NewManualReader()
	return &telemetry{
		tp:     sdktrace.NewTracerProvider(opts...),
		mp:     sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader), sdkmetric.WithResource(res)),
		reader: reader,
	}, nil
}

func (t *telemetry) outcomes(ctx context.Context) (outcomeCounts, error) {
	return readOutcomes(ctx, t.reader)
}

// shutdown flushes the spans still batched.
func (t *telemetry) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = t.tp.Shutdown(ctx)
	_ = t.mp.Shutdown(ctx)
}

// schema holds the run's table names: fresh ones per run, dropped at the end.
type schema struct {
	db          *sql.DB
	dialect     dedupe.Dialect
	claims      string
	orders      string
	charges     string
	emails      string
	outboxTopic string
}

func newSchema(ctx context.Context, db *sql.DB, d dedupe.Dialect, runID string) (*schema, error) {
	s := &schema{
		db: db, dialect: d,
		claims:      "orders_claims_" + runID,
		orders:      "orders_" + runID,
		charges:     "orders_charges_" + runID,
		emails:      "orders_emails_" + runID,
		outboxTopic: "orders_outbox_" + runID,
	}
	// A real service runs these in its migrations.
	ddl, err := dedupe.Schema(d, s.claims)
	if err != nil {
		return nil, err
	}
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
	if s.dialect == dedupe.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func (s *schema) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, t := range []string{s.claims, s.orders, s.charges, s.emails} {
		_, _ = s.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t)
	}
}

func (s *schema) dropOutbox(ob *outbox.Outbox) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q := `"`
	if s.dialect == dedupe.MySQL {
		q = "`"
	}
	for _, t := range []string{ob.Table(), ob.Table() + "_relays"} {
		_, _ = s.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+q+t+q)
	}
}

type topicNames struct {
	placed, charged string
	all             []string
}

// broker is GoChannel or RabbitMQ behind Watermill's interfaces.
type broker struct {
	system string
	pub    message.Publisher
	sub    message.Subscriber
	topics topicNames
	close  func()
}

func newBroker(amqpURL, runID string) (*broker, error) {
	t := topicNames{placed: "orders.placed." + runID, charged: "orders.charged." + runID}
	t.all = []string{t.placed, t.charged,
		t.placed + ".dead_letter", t.placed + ".poison", t.charged + ".dead_letter", t.charged + ".poison"}
	logger := watermill.NopLogger{}
	if amqpURL == "" {
		ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)
		return &broker{system: "gochannel", pub: ps, sub: ps, topics: t, close: func() { _ = ps.Close() }}, nil
	}
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return nil, err
	}
	cfg := amqp.NewDurableQueueConfig(amqpURL)
	cfg.Marshaler = m
	cfg.Publish.ConfirmDelivery = true
	cfg.Consume.Qos.PrefetchCount = 16
	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	// Declare the queues now, so that copies published to the dead-letter
	// and poison topics are kept even though nothing consumes them here.
	for _, q := range t.all {
		if err := sub.SubscribeInitialize(q); err != nil {
			_ = pub.Close()
			_ = sub.Close()
			return nil, fmt.Errorf("rabbitmq: declare %s: %w", q, err)
		}
	}
	return &broker{system: "rabbitmq", pub: pub, sub: sub, topics: t, close: func() {
		_ = pub.Close()
		_ = sub.Close()
		deleteQueues(amqpURL, t.all)
	}}, nil
}

// deleteQueues removes the run's queues.
func deleteQueues(url string, queues []string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	var errs []error
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			errs = append(errs, err)
		}
	}
	_ = errors.Join(errs...)
}
