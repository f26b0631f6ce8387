package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/dedupe"
)

// DefaultTopic is the watermill-sql topic of the outbox when Config.Topic is
// empty. Its rows live in the table "watermill_settle_outbox", its forwarding
// offsets in "watermill_offsets_settle_outbox".
const DefaultTopic = "settle_outbox"

// Config configures an Outbox.
type Config struct {
	// Dialect is the database's SQL flavour: dedupe.Postgres (pgx),
	// dedupe.MySQL or dedupe.SQLite. Required.
	Dialect dedupe.Dialect
	// Topic names the outbox: the watermill-sql topic whose table holds the
	// rows. Defaults to DefaultTopic. Letters, digits, '_' and '-' only.
	Topic string
	// Propagator writes the trace context of the publishing code into each
	// message's metadata, so that the trace continues after the forwarder.
	// Defaults to otel.GetTextMapPropagator() at the time of New.
	Propagator propagation.TextMapPropagator
	// TracerProvider makes the outbox's spans: "create <topic>" when a
	// message is written, "send <topic>" when the relay publishes it.
	// Defaults to otel.GetTracerProvider() at the time of New.
	TracerProvider trace.TracerProvider
	// SchemaAdapter and OffsetsAdapter replace the dialect's watermill-sql
	// adapters (advanced: custom table names). Set both or neither.
	SchemaAdapter  wsql.SchemaAdapter
	OffsetsAdapter wsql.OffsetsAdapter
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

var topicRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,48}$`)

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = DefaultTopic
	}
	if c.Propagator == nil {
		c.Propagator = otel.GetTextMapPropagator()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch c.Dialect {
	case dedupe.Postgres, dedupe.MySQL, dedupe.SQLite:
	default:
		return fmt.Errorf("outbox: Config.Dialect must be postgres, mysql or sqlite, got %q", string(c.Dialect))
	}
	if !topicRE.MatchString(c.Topic) {
		return fmt.Errorf("outbox: Config.Topic %q must be 1-48 letters, digits, '_' or '-'", c.Topic)
	}
	if (c.SchemaAdapter == nil) != (c.OffsetsAdapter == nil) {
		return errors.New("outbox: Config.SchemaAdapter and Config.OffsetsAdapter must be set together")
	}
	return nil
}

// Outbox is the transactional outbox of one database. Publishers bound to a
// transaction write messages as rows of the outbox table, committed or rolled
// back with the transaction; a Relay forwards the committed rows to the real
// publisher. It is built on watermill-sql and Watermill's forwarder component:
// each row is a forwarder envelope that carries the destination topic and the
// whole original message, so message UUIDs of any length survive (the row's
// own 36-character uuid column holds the envelope's UUID).
//
// An Outbox holds no connections and needs no Close.
type Outbox struct {
	cfg     Config
	schema  wsql.SchemaAdapter
	offsets wsql.OffsetsAdapter
	q       tableQueries
}

// New checks cfg and returns an Outbox. It touches no database.
func New(cfg Config) (*Outbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := &Outbox{cfg: cfg, schema: cfg.SchemaAdapter, offsets: cfg.OffsetsAdapter}
	if o.schema == nil {
		switch cfg.Dialect {
		case dedupe.Postgres:
			o.schema, o.offsets = wsql.DefaultPostgreSQLSchema{}, wsql.DefaultPostgreSQLOffsetsAdapter{}
		case dedupe.MySQL:
			o.schema, o.offsets = wsql.DefaultMySQLSchema{}, wsql.DefaultMySQLOffsetsAdapter{}
		case dedupe.SQLite:
			o.schema, o.offsets = SQLiteSchema{SubscribeBatchSize: 10}, SQLiteOffsetsAdapter{}
		}
	}
	o.q = newTableQueries(cfg.Dialect, o.schema, o.offsets, cfg.Topic)
	return o, nil
}

// Topic returns the outbox's watermill-sql topic.
func (o *Outbox) Topic() string { return o.cfg.Topic }

// Schema returns the statements that create the outbox table and its
// offsets table, for your migrations. Run them outside any transaction of
// the application (PostgreSQL's include an advisory lock that only holds in a
// transaction of their own: InitSchema does this for you).
func (o *Outbox) Schema() ([]string, error) {
	qs, err := o.schemaQueries()
	if err != nil {
		return nil, err
	}
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = q.Query
	}
	return out, nil
}

func (o *Outbox) schemaQueries() ([]wsql.Query, error) {
	qs, err := o.schema.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: o.cfg.Topic})
	if err != nil {
		return nil, fmt.Errorf("outbox: schema: %w", err)
	}
	oqs, err := o.offsets.SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams{Topic: o.cfg.Topic})
	if err != nil {
		return nil, fmt.Errorf("outbox: offsets schema: %w", err)
	}
	return append(qs, oqs...), nil
}

// InitSchema creates the outbox tables if they do not exist, in a
// transaction of its own on db. Call it from your migrations or at deploy
// time, never inside an application transaction; settle never calls it by
// itself.
func (o *Outbox) InitSchema(ctx context.Context, db *sql.DB) error {
	qs, err := o.schemaQueries()
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox: init schema: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	for _, q := range qs {
		if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return fmt.Errorf("outbox: init schema: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: init schema: commit: %w", err)
	}
	return nil
}

// Publisher returns a publisher that writes into the outbox on exec, which
// is normally the caller's transaction: wsql.TxFromStdSQL(tx) for a *sql.Tx,
// wsql.TxFromPgx(tx) for a pgx.Tx. Messages published through it are
// forwarded only if that transaction commits. Use it for the transaction's
// lifetime only; it needs no Close.
//
// Publish writes the trace context of each message's context (msg.Context())
// into its metadata with the configured propagator.
func (o *Outbox) Publisher(exec wsql.ContextExecutor) (message.Publisher, error) {
	if exec == nil {
		return nil, errors.New("outbox: Publisher: exec is nil")
	}
	p, err := wsql.NewPublisher(exec, wsql.PublisherConfig{SchemaAdapter: o.schema}, o.cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return &publisher{
		out: forwarder.NewPublisher(p, forwarder.PublisherConfig{ForwarderTopic: o.cfg.Topic}),
		o:   o,
	}, nil
}

// TxPublisher is Publisher for a *sql.Tx.
func (o *Outbox) TxPublisher(tx *sql.Tx) (message.Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: TxPublisher: tx is nil")
	}
	return o.Publisher(wsql.TxFromStdSQL(tx))
}

type publisher struct {
	out message.Publisher
	o   *Outbox
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == "" {
		return errors.New("outbox: publish: empty destination topic")
	}
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		spans[i] = p.o.startCreate(topic, m)
	}
	err := p.out.Publish(topic, msgs...)
	endSpans(spans, err)
	if err != nil {
		return fmt.Errorf("outbox: publish to %q: %w", topic, err)
	}
	return nil
}

// Close does nothing: the publisher lives as long as its transaction.
func (p *publisher) Close() error { return nil }
