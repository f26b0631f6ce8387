package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/internal/telemetry"
	"github.com/settle-go/settle/sqldb"
)

// DefaultTopic names the outbox when Config.Topic is empty: its rows live in
// the table "settle_outbox", its relays' heartbeats in "settle_outbox_relays",
// and on PostgreSQL its commits are announced on the channel "settle_outbox".
const DefaultTopic = "settle_outbox"

// DefaultStuckAfter is Config.StuckAfter when unset.
const DefaultStuckAfter = time.Minute

// Config configures an Outbox.
type Config struct {
	// Dialect is the database's SQL flavour: sqldb.Postgres (pgx),
	// sqldb.MySQL (MySQL >= 8.0 or MariaDB >= 10.6, for SKIP LOCKED) or
	// sqldb.SQLite. Required.
	Dialect sqldb.Dialect
	// Topic names the outbox: its table, the table of its relays (Topic +
	// "_relays") and its PostgreSQL notification channel. Defaults to
	// DefaultTopic. 1-48 letters, digits, '_' or '-'.
	Topic string
	// StuckAfter is the age past which Status calls a pending row old: old
	// rows with a live relay mean the relay is stuck or passing them over.
	// Defaults to DefaultStuckAfter (1m). Must be > 0.
	StuckAfter time.Duration
	// NotifyAfterCommit, on PostgreSQL, leaves pg_notify out of the
	// INSERT. PostgreSQL serialises the commits of all transactions that
	// notified (a cluster-wide lock held through the commit's WAL flush),
	// which caps the rate of outbox transactions: in bench/outbox, 4
	// producers committed about 0.6x as many as without it. With it set,
	// the wake-up is sent after the commit instead: Notify wakes the
	// relays of this process at once, and asks each Notifier of this
	// Outbox (NewNotifier) for a coalesced NOTIFY that wakes relays in
	// other processes. Without a Notifier those find the rows at their
	// PollInterval. Default false: the INSERT notifies, and every commit
	// wakes every relay without any call after it. Ignored on MySQL and
	// SQLite, which have no NOTIFY.
	NotifyAfterCommit bool
	// Propagator writes the trace context of the publishing code into each
	// message's metadata, so that the trace continues after the relay.
	// Defaults to OTel's global propagator once the application has set
	// one, and to W3C Trace Context and Baggage while it is OTel's no-op.
	Propagator propagation.TextMapPropagator
	// TracerProvider makes the outbox's spans: "create <topic>" when a
	// message is written, "send <topic>" when the relay publishes it.
	// Defaults to otel.GetTracerProvider() at the time of New.
	TracerProvider trace.TracerProvider
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

var topicRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,48}$`)

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = DefaultTopic
	}
	if c.StuckAfter == 0 {
		c.StuckAfter = DefaultStuckAfter
	}
	if c.Propagator == nil {
		c.Propagator = telemetry.Propagator()
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
	case sqldb.Postgres, sqldb.MySQL, sqldb.SQLite:
	default:
		return fmt.Errorf("outbox: Config.Dialect must be postgres, mysql or sqlite, got %q", string(c.Dialect))
	}
	if !topicRE.MatchString(c.Topic) {
		return fmt.Errorf("outbox: Config.Topic %q must be 1-48 letters, digits, '_' or '-'", c.Topic)
	}
	if c.StuckAfter <= 0 {
		return fmt.Errorf("outbox: Config.StuckAfter must be > 0, got %v", c.StuckAfter)
	}
	return nil
}

// Outbox is the transactional outbox of one database. Publishers bound to a
// transaction write messages as rows of the outbox table, committed or rolled
// back with the transaction; a Relay forwards the committed rows to the real
// publisher and marks each one forwarded. Each row carries the destination
// topic and the whole message (UUID of any length, metadata, payload).
//
// An Outbox holds no connections and needs no Close. It is safe for
// concurrent use.
type Outbox struct {
	cfg Config
	q   statements

	mu        sync.Mutex
	wakers    map[chan struct{}]struct{} // relays of this process
	notifiers map[*Notifier]struct{}
}

// New checks cfg and returns an Outbox. It touches no database.
func New(cfg Config) (*Outbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Outbox{cfg: cfg, q: newStatements(cfg.Dialect, cfg.Topic), wakers: map[chan struct{}]struct{}{}, notifiers: map[*Notifier]struct{}{}}, nil
}

// Config returns the outbox's configuration, defaults applied.
func (o *Outbox) Config() Config { return o.cfg }

// Topic returns the outbox's name (Config.Topic).
func (o *Outbox) Topic() string { return o.cfg.Topic }

// Table returns the name of the outbox table, unquoted.
func (o *Outbox) Table() string { return o.q.table }

// Schema returns the statements that create the outbox table, its index of
// pending rows and the relays' table, for your migrations. Run them outside
// any transaction of the application (InitSchema does this for you).
// The error is always nil; it is kept for callers of earlier versions.
func (o *Outbox) Schema() ([]string, error) { return slices.Clone(o.q.schema), nil }

// SchemaUpgrade returns the statements that bring an outbox table created
// by an earlier version of settle (without the columns attempts,
// last_error, next_attempt_at and set_aside_at) to the shape of Schema: they
// add the columns (existing rows start with no failure), create the indexes
// of rows to forward and of rows set aside, and drop the earlier index of
// pending rows. Run them once, in a migration, outside any application
// transaction, while no relay of an earlier version runs; Check says
// whether they are needed. On PostgreSQL and SQLite they can run again
// without harm; MySQL has no IF NOT EXISTS for columns.
func (o *Outbox) SchemaUpgrade() []string { return slices.Clone(o.q.upgrade) }

// InitSchema creates the outbox's tables if they do not exist. Call it from
// your migrations or at deploy time, never inside an application
// transaction; settle never calls it by itself. The statements run one by
// one (MySQL commits each CREATE by itself anyway).
func (o *Outbox) InitSchema(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return errors.New("outbox: InitSchema: db is nil")
	}
	return o.initSchema(ctx, sqlConn(db))
}

func (o *Outbox) initSchema(ctx context.Context, db conn) error {
	for _, q := range o.q.schema {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("outbox: init schema: %w", err)
		}
	}
	return nil
}

// ErrSchema is returned (wrapped) by Check when a table of the outbox is
// missing or lacks columns. Its message says what to run.
var ErrSchema = errors.New("outbox: schema")

// Check reports whether the outbox's tables exist with the columns settle
// needs. A missing or mis-shaped table is an error wrapping ErrSchema that
// names the table and the missing columns and says how to create it: `settle
// outbox schema -dialect <dialect> -topic <topic>` prints the statements (or
// call InitSchema). Other errors are the database's. Check only reads.
func (o *Outbox) Check(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return errors.New("outbox: Check: db is nil")
	}
	return o.check(ctx, sqlConn(db))
}

func (o *Outbox) check(ctx context.Context, db conn) error {
	var problems []string
	upgrade := false
	for _, t := range []struct {
		name string
		cols []string
	}{{o.q.table, outboxColumns}, {o.q.relays, relayColumns}} {
		have, err := o.columns(ctx, db, t.name)
		if err != nil {
			return fmt.Errorf("outbox: check %s: %w", t.name, err)
		}
		if len(have) == 0 {
			problems = append(problems, fmt.Sprintf("table %s does not exist", t.name))
			continue
		}
		var missing []string
		for _, c := range t.cols {
			if !have[c] {
				missing = append(missing, c)
			}
		}
		switch {
		case len(missing) == 0:
		case t.name == o.q.table && !slices.ContainsFunc(missing, func(c string) bool { return !slices.Contains(failureColumns, c) }):
			upgrade = true
			problems = append(problems, fmt.Sprintf("table %s lacks column(s) %s, which the relay needs to retry and set aside rows one by one: it was created by an earlier version of settle", t.name, strings.Join(missing, ", ")))
		default:
			problems = append(problems, fmt.Sprintf("table %s lacks column(s) %s (earlier versions of settle kept the outbox in a watermill-sql table, watermill_<topic>: drain it with the old relay first)", t.name, strings.Join(missing, ", ")))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	if upgrade && len(problems) == 1 {
		return fmt.Errorf("%w: %s; add them with the statements of `settle outbox schema -upgrade -dialect %s -topic %s` (Outbox.SchemaUpgrade; docs/outbox.md, \"Upgrading\") in a migration",
			ErrSchema, problems[0], o.cfg.Dialect, o.cfg.Topic)
	}
	return fmt.Errorf("%w: %s; run the statements of `settle outbox schema -dialect %s -topic %s` (or Outbox.InitSchema) in a migration",
		ErrSchema, strings.Join(problems, "; "), o.cfg.Dialect, o.cfg.Topic)
}

func (o *Outbox) columns(ctx context.Context, db conn, table string) (map[string]bool, error) {
	rows, err := db.QueryContext(ctx, o.q.columns, table)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			return nil, err
		}
		have[strings.ToLower(c)] = true
	}
	return have, rowsErr(rows)
}

// Notify tells the relays of this Outbox that a transaction that published
// into it has committed, so they forward at once instead of at their next
// poll. Call it after the commit returns (pipeline's transactional handlers
// do). Relays running in this process are woken directly. Relays in other
// processes: on PostgreSQL the commit itself woke them through
// LISTEN/NOTIFY, unless Config.NotifyAfterCommit is set, in which case
// Notify asks this Outbox's Notifiers to send the NOTIFY now; on MySQL and
// SQLite they find the rows at their next poll. Notify never blocks.
func (o *Outbox) Notify() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for w := range o.wakers {
		poke(w)
	}
	for n := range o.notifiers {
		poke(n.kick) // a request already waiting absorbs this one
	}
}

// poke sends on a wake-up channel of capacity 1 without blocking: a wake-up
// already pending absorbs this one.
func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (o *Outbox) addWaker(w chan struct{}) {
	o.mu.Lock()
	o.wakers[w] = struct{}{}
	o.mu.Unlock()
}

func (o *Outbox) removeWaker(w chan struct{}) {
	o.mu.Lock()
	delete(o.wakers, w)
	o.mu.Unlock()
}

// Publisher returns a publisher that writes into the outbox on exec, which
// is normally the caller's transaction: wsql.TxFromStdSQL(tx) for a *sql.Tx,
// wsql.TxFromPgx(tx) for a pgx.Tx. Messages published through it are
// forwarded only if that transaction commits. Use it for the transaction's
// lifetime only; it needs no Close. After the commit, call Notify so that a
// relay of this process forwards at once.
//
// Publish writes the trace context of each message's context (msg.Context())
// into its metadata with the configured propagator.
func (o *Outbox) Publisher(exec wsql.ContextExecutor) (message.Publisher, error) {
	if exec == nil {
		return nil, errors.New("outbox: Publisher: exec is nil")
	}
	return &publisher{exec: exec, o: o}, nil
}

// TxPublisher is Publisher for a *sql.Tx.
func (o *Outbox) TxPublisher(tx *sql.Tx) (message.Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: TxPublisher: tx is nil")
	}
	return o.Publisher(wsql.TxFromStdSQL(tx))
}

// maxPublishBatch bounds the messages of one INSERT: 4 bound parameters each,
// under every driver's limit (65535 on PostgreSQL and MySQL, 32766 on SQLite).
const maxPublishBatch = 1000

type publisher struct {
	exec wsql.ContextExecutor
	o    *Outbox
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == "" {
		return errors.New("outbox: publish: empty destination topic")
	}
	if len(msgs) == 0 {
		return nil
	}
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		spans[i] = p.o.startCreate(topic, m)
	}
	err := p.insert(topic, msgs)
	endSpans(spans, err)
	if err != nil {
		return fmt.Errorf("outbox: publish to %q: %w", topic, err)
	}
	return nil
}

func (p *publisher) insert(topic string, msgs []*message.Message) error {
	for chunk := range slices.Chunk(msgs, maxPublishBatch) {
		args := make([]any, 0, 4*len(chunk)+1)
		ctx := chunk[0].Context()
		for _, m := range chunk {
			md, err := encodeMetadata(m.Metadata)
			if err != nil {
				return fmt.Errorf("metadata of message %s: %w", m.UUID, err)
			}
			payload := []byte(m.Payload)
			if payload == nil {
				payload = []byte{}
			}
			args = append(args, m.UUID, topic, payload, md)
		}
		notify := p.o.cfg.Dialect == sqldb.Postgres && !p.o.cfg.NotifyAfterCommit
		if notify {
			args = append(args, p.o.q.table)
		}
		if _, err := p.exec.ExecContext(ctx, p.o.q.insert(len(chunk), notify), args...); err != nil {
			return err
		}
	}
	return nil
}

// Close does nothing: the publisher lives as long as its transaction.
func (p *publisher) Close() error { return nil }
