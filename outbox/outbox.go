package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/internal/telemetry"
	"github.com/settle-go/settle/sqldb"
)

// defaultTopic names the outbox when Config.Topic is empty: its rows live in
// the table "settle_outbox", its relays' heartbeats in "settle_outbox_relays",
// and on PostgreSQL its commits are announced on the channel "settle_outbox".
const defaultTopic = "settle_outbox"

// defaultStuckAfter is Config.StuckAfter when unset.
const defaultStuckAfter = time.Minute

// Config configures an Outbox.
type Config struct {
	// Topic names the outbox: its table, the table of its relays (Topic +
	// "_relays") and its PostgreSQL notification channel. Defaults to
	// "settle_outbox". 1-48 letters, digits, '_' or '-'.
	Topic string
	// StuckAfter is the age past which Status calls a pending row old: old
	// rows with a live relay mean the relay is stuck or passing them over.
	// Defaults to 1m. Must be > 0.
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
	// Tracing configures the outbox's spans, "create <topic>" when a
	// message is written and "send <topic>" when the relay publishes it:
	// the same options as middleware.NewTracing. It reads
	// settle.WithTracerProvider (defaults to otel.GetTracerProvider() at
	// the time of New) and settle.WithPropagators, which writes the trace
	// context of the publishing code into each message's metadata so that
	// the trace continues after the relay (defaults to OTel's global
	// propagator once the application has set one, and to W3C Trace
	// Context and Baggage while it is OTel's no-op), and
	// settle.WithMeterProvider, which records the relay's metrics
	// (settle.outbox.forwarded, settle.outbox.failed, settle.outbox.pending,
	// settle.outbox.lag and settle.outbox.set_aside; defaults to
	// otel.GetMeterProvider()). It ignores settle.WithMessagingSystem (the outbox's
	// spans say messaging.system "settle_outbox"), settle.WithLinkToProducer
	// and settle.WithSettleWait.
	Tracing []settle.Option
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

var topicRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,48}$`)

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = defaultTopic
	}
	if c.StuckAfter == 0 {
		c.StuckAfter = defaultStuckAfter
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
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
// TTx is the transaction type of the database's driver: *sql.Tx for
// sqldb.Std, pgx.Tx for sqldb.Pgx. Every method runs on that driver.
//
// An Outbox holds no connections of its own (it uses the driver's pool) and
// needs no Close. It is safe for concurrent use.
type Outbox[TTx any] struct {
	db sqldb.Driver[TTx]
	c  *core
}

// core is what the Outbox's relays, notifiers and publishers share, whatever
// the driver's transaction type.
type core struct {
	cfg Config
	tel telemetry.Config // from cfg.Tracing
	q   statements
	db  database

	mu        sync.Mutex
	wakers    map[chan struct{}]struct{} // relays of this process
	notifiers map[*Notifier]struct{}
}

// database is a sqldb.Driver with its transaction type left out, for the
// relay and the notifier, which are not generic.
type database interface {
	Dialect() sqldb.Dialect
	DB() sqldb.Executor
	Listen(ctx context.Context, channel string, wake func(), every time.Duration, idle func(context.Context, sqldb.Executor)) error
	MaxConns() int
	begin(ctx context.Context, opts *sql.TxOptions, setup string) (txn, error)
}

// txn is a transaction of a database: statements run on its Executor.
type txn struct {
	sqldb.Executor
	commit   func(context.Context) error
	rollback func(context.Context) error
}

type erased[TTx any] struct{ sqldb.Driver[TTx] }

func (e erased[TTx]) begin(ctx context.Context, opts *sql.TxOptions, setup string) (txn, error) {
	tx, err := e.Begin(ctx, opts, setup)
	if err != nil {
		return txn{}, err
	}
	return txn{
		Executor: e.Tx(tx),
		commit:   func(ctx context.Context) error { return e.Commit(ctx, tx) },
		rollback: func(ctx context.Context) error { return e.Rollback(ctx, tx) },
	}, nil
}

// New checks cfg and returns the outbox of db. It touches no database.
func New[TTx any](db sqldb.Driver[TTx], cfg Config) (*Outbox[TTx], error) {
	if db == nil {
		return nil, errors.New("outbox: New: db is nil")
	}
	if err := sqlkit.ValidDialect(db.Dialect()); err != nil {
		return nil, fmt.Errorf("outbox: New: %w", err)
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &core{cfg: cfg, tel: telemetry.Resolve(cfg.Tracing), q: newStatements(db.Dialect(), cfg.Topic), db: erased[TTx]{db}, wakers: map[chan struct{}]struct{}{}, notifiers: map[*Notifier]struct{}{}}
	return &Outbox[TTx]{db: db, c: c}, nil
}

// Topic returns the outbox's name (Config.Topic).
func (o *Outbox[TTx]) Topic() string { return o.c.cfg.Topic }

// Table returns the name of the outbox table, unquoted.
func (o *Outbox[TTx]) Table() string { return o.c.q.table }

// Schema returns the statements that create the outbox table, its indexes
// and the relays' table, in the driver's dialect, for your migrations. Run
// them outside any transaction of the application (InitSchema does this for
// you).
func (o *Outbox[TTx]) Schema() []string { return slices.Clone(o.c.q.schema) }

// SchemaUpgrade returns the statements that bring an outbox table created
// by an earlier version of settle (without the columns attempts,
// last_error, next_attempt_at and set_aside_at) to the shape of Schema: they
// add the columns (existing rows start with no failure), create the indexes
// of rows to forward and of rows set aside, and drop the earlier index of
// pending rows. Run them once, in a migration, outside any application
// transaction, while no relay of an earlier version runs; Check says
// whether they are needed. On PostgreSQL and SQLite they can run again
// without harm; MySQL has no IF NOT EXISTS for columns.
func (o *Outbox[TTx]) SchemaUpgrade() []string { return slices.Clone(o.c.q.upgrade) }

// InitSchema creates the outbox's tables if they do not exist. Call it from
// your migrations or at deploy time, never inside an application
// transaction; settle never calls it by itself. The statements run one by
// one, on the pool (MySQL commits each CREATE by itself anyway).
func (o *Outbox[TTx]) InitSchema(ctx context.Context) error {
	for _, q := range o.c.q.schema {
		if _, err := o.db.DB().Exec(ctx, q); err != nil {
			return fmt.Errorf("outbox: init schema: %w", err)
		}
	}
	return nil
}

// Check reports whether the outbox's tables exist with the columns settle
// needs. A missing or mis-shaped table is a *sqldb.SchemaError (it wraps
// sqldb.ErrSchema) that names the table and the missing columns, holds the
// statements that create (or upgrade) it, and says which command prints
// them: `settle outbox schema -dialect <dialect> -topic <topic>` (or call
// InitSchema). Other errors are the database's. Check only reads.
func (o *Outbox[TTx]) Check(ctx context.Context) error { return o.c.check(ctx) }

func (c *core) check(ctx context.Context) error {
	var problems []string
	upgrade := false
	for _, t := range []struct {
		name string
		cols []string
	}{{c.q.table, outboxColumns}, {c.q.relays, relayColumns}} {
		have, err := c.columns(ctx, t.name)
		if err != nil {
			return fmt.Errorf("outbox: check %s: %w", t.name, err)
		}
		if len(have) == 0 {
			problems = append(problems, fmt.Sprintf("table %s does not exist", t.name))
			continue
		}
		var missing []string
		for _, col := range t.cols {
			if !have[col] {
				missing = append(missing, col)
			}
		}
		switch {
		case len(missing) == 0:
		case t.name == c.q.table && !slices.ContainsFunc(missing, func(col string) bool { return !slices.Contains(failureColumns, col) }):
			upgrade = true
			problems = append(problems, fmt.Sprintf("table %s lacks column(s) %s, which the relay needs to retry and set aside rows one by one: it was created by an earlier version of settle", t.name, strings.Join(missing, ", ")))
		default:
			problems = append(problems, fmt.Sprintf("table %s lacks column(s) %s (earlier versions of settle kept the outbox in a watermill-sql table, watermill_<topic>: drain it with the old relay first)", t.name, strings.Join(missing, ", ")))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	d := c.db.Dialect()
	if upgrade && len(problems) == 1 {
		return &sqldb.SchemaError{
			Table:   c.q.table,
			Problem: problems[0],
			Fix:     fmt.Sprintf("add them with the statements of `settle outbox schema -upgrade -dialect %s -topic %s` (Outbox.SchemaUpgrade; docs/outbox.md, \"Upgrading\")", d, c.cfg.Topic),
			DDL:     slices.Clone(c.q.upgrade),
		}
	}
	return &sqldb.SchemaError{
		Table:   c.q.table,
		Problem: strings.Join(problems, "; "),
		Fix:     fmt.Sprintf("create them with the statements of `settle outbox schema -dialect %s -topic %s` (or Outbox.InitSchema)", d, c.cfg.Topic),
		DDL:     slices.Clone(c.q.schema),
	}
}

func (c *core) columns(ctx context.Context, table string) (map[string]bool, error) {
	have := map[string]bool{}
	err := c.db.DB().Query(ctx, c.q.columns, []any{table}, func(scan func(...any) error) error {
		var col string
		if err := scan(&col); err != nil {
			return err
		}
		have[strings.ToLower(col)] = true
		return nil
	})
	return have, err
}

// Notify tells the relays of this Outbox that a transaction that published
// into it has committed, so they forward at once instead of at their next
// poll. Call it after the commit returns (pipeline's transactional handlers
// do). Relays running in this process are woken directly. Relays in other
// processes: on PostgreSQL the commit itself woke them through
// LISTEN/NOTIFY, unless Config.NotifyAfterCommit is set, in which case
// Notify asks this Outbox's running Notifiers to send the NOTIFY now; on
// MySQL and SQLite they find the rows at their next poll. Notify never
// blocks.
func (o *Outbox[TTx]) Notify() { o.c.notify() }

func (c *core) notify() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for w := range c.wakers {
		poke(w)
	}
	for n := range c.notifiers {
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

func (c *core) addWaker(w chan struct{}) {
	c.mu.Lock()
	c.wakers[w] = struct{}{}
	c.mu.Unlock()
}

func (c *core) removeWaker(w chan struct{}) {
	c.mu.Lock()
	delete(c.wakers, w)
	c.mu.Unlock()
}

// TxPublisher returns a publisher that writes into the outbox in tx, the
// caller's transaction: messages published through it are forwarded only if
// tx commits. Use it for the transaction's lifetime only; it needs no Close.
// After the commit, call Notify so that a relay of this process forwards at
// once.
//
// Publish writes the trace context of each message's context (msg.Context())
// into its metadata with the configured propagator.
func (o *Outbox[TTx]) TxPublisher(tx TTx) (message.Publisher, error) {
	if isNil(tx) {
		return nil, errors.New("outbox: TxPublisher: tx is nil")
	}
	return &publisher{exec: o.db.Tx(tx), o: o.c}, nil
}

// isNil reports whether v is a nil interface or pointer.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}

// maxPublishBatch bounds the messages of one INSERT: 4 bound parameters each,
// under every driver's limit (65535 on PostgreSQL and MySQL, 32766 on SQLite).
const maxPublishBatch = 1000

type publisher struct {
	exec sqldb.Executor
	o    *core
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
		notify := p.o.q.d == sqldb.Postgres && !p.o.cfg.NotifyAfterCommit
		if notify {
			args = append(args, p.o.q.table)
		}
		if _, err := p.exec.Exec(ctx, p.o.q.insert(len(chunk), notify), args...); err != nil {
			return err
		}
	}
	return nil
}

// Close does nothing: the publisher lives as long as its transaction.
func (p *publisher) Close() error { return nil }
