package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/settle-go/settle/internal/amqpcheck"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/telemetry"
	"github.com/settle-go/settle/sqldb"
)

// maxBatchSize is the largest RelayConfig.BatchSize.
const maxBatchSize = 1000

// Defaults of RelayConfig.
const (
	defaultBatchBytes       = 16 << 20
	defaultMaxAttempts      = 10
	defaultMaxRetryInterval = time.Minute
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// PollInterval is how often an idle relay looks for committed rows
	// nobody told it about: the fallback behind PostgreSQL's LISTEN/NOTIFY
	// and Outbox.Notify, and the lag of a row committed by another process
	// on MySQL and SQLite. Each poll is one statement, the heartbeat
	// included: on PostgreSQL the heartbeat rides in the poll, which runs
	// on the LISTEN connection, where no pool's health check pings first;
	// on MySQL and SQLite it takes the place of one poll every
	// HeartbeatInterval, so such a row may then wait up to two
	// PollIntervals. An idle relay polls every HeartbeatInterval instead
	// when that is shorter, to renew its heartbeat. Defaults to 1s. Must
	// be > 0.
	PollInterval time.Duration
	// BatchSize is the most rows one relay transaction claims and
	// forwards. Defaults to 100. Must be 1-1000.
	BatchSize int
	// BatchBytes bounds the payload and metadata bytes of one batch: the
	// relay claims rows in offset order while their total stays within it,
	// and a row larger than BatchBytes is claimed alone. It bounds what a
	// relay holds in memory at once. Defaults to 16 MiB. Must be > 0.
	BatchBytes int64
	// AckDeadline bounds one batch: claiming its rows, publishing them and
	// committing their forwarded mark. A batch that overruns is rolled back
	// and its rows are forwarded again (a duplicate of those already
	// published); the row whose publish did not return counts a failed
	// publish, and the next batch passes over it. Defaults to 30s, or 5s
	// on SQLite, where the relay holds the database's write lock for the
	// batch and the deadline must stay below the busy timeout of other
	// writers (10s in settle's DSN). Must be > 0.
	AckDeadline time.Duration
	// RetryInterval is how long the relay waits after a failed batch (the
	// broker refused, the database is gone) before trying again, so that an
	// outage is not a hot loop of failing publishes and error logs. It is
	// also the first delay of a row whose publish failed: the row is not
	// claimed again before it, and the delay doubles at each failure of
	// that row, up to MaxRetryInterval, while the rows behind it are
	// forwarded. Defaults to 1s. Must be > 0.
	RetryInterval time.Duration
	// MaxRetryInterval caps the delay before a failed row's next attempt.
	// Defaults to 1m. Must be >= RetryInterval.
	MaxRetryInterval time.Duration
	// MaxAttempts is how many failed publishes of one row the relay
	// allows before it sets the row aside: the row stays in the outbox
	// table, is never forwarded or pruned, and is shown by Status, Failed
	// and `settle outbox status` until Requeue (`settle outbox retry`) puts
	// it back. A row is set aside at its MaxAttempts-th failure only once
	// the broker has shown that it works and refuses this row (the relay
	// published some other row after this row's first failure) or this
	// topic (it published a row to another topic after this topic began to
	// fail); until then the row keeps its backoff, so a broker outage makes
	// rows wait and sets none aside, and a row alone on a quiet outbox waits
	// for the next row forwarded. A publish that fails right after another
	// failure in one batch counts for no row (the broker may refuse
	// everything, or be reconnecting). Defaults to 10.
	// Must be >= 1.
	MaxAttempts int
	// HeartbeatInterval is how often the relay renews its row in the relays
	// table; Status counts a relay as alive for three intervals after its
	// last heartbeat. Defaults to 10s. Must be > 0.
	HeartbeatInterval time.Duration
	// PoisonTopic receives, unchanged, rows whose metadata is neither a
	// JSON object of strings nor settle's base64 form of one (written by
	// something else into the outbox table), so that they do not block the
	// relay; they are counted as failed and
	// marked forwarded. Defaults to the outbox topic + "_poison".
	PoisonTopic string
	// CloseTimeout bounds Close's wait for the batch in progress. Defaults
	// to 30s. Must be > 0.
	CloseTimeout time.Duration
	// Logger defaults to the Outbox's logger.
	Logger watermill.LoggerAdapter
}

func (c *RelayConfig) setDefaults(o *core) {
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = 30 * time.Second
		if o.q.d == sqldb.SQLite {
			c.AckDeadline = 5 * time.Second
		}
	}
	if c.BatchBytes == 0 {
		c.BatchBytes = defaultBatchBytes
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = time.Second
	}
	if c.MaxRetryInterval == 0 {
		c.MaxRetryInterval = max(defaultMaxRetryInterval, c.RetryInterval)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = defaultMaxAttempts
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = 10 * time.Second
	}
	if c.PoisonTopic == "" {
		c.PoisonTopic = o.cfg.Topic + "_poison"
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = o.cfg.Logger
	}
}

// validate reports the first invalid field.
func (c RelayConfig) validate() error {
	switch {
	case c.PollInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.PollInterval must be > 0, got %v", c.PollInterval)
	case c.BatchSize < 1 || c.BatchSize > maxBatchSize:
		return fmt.Errorf("outbox: RelayConfig.BatchSize must be 1-%d, got %d", maxBatchSize, c.BatchSize)
	case c.AckDeadline <= 0:
		return fmt.Errorf("outbox: RelayConfig.AckDeadline must be > 0, got %v", c.AckDeadline)
	case c.BatchBytes <= 0:
		return fmt.Errorf("outbox: RelayConfig.BatchBytes must be > 0, got %d", c.BatchBytes)
	case c.RetryInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.RetryInterval must be > 0, got %v", c.RetryInterval)
	case c.MaxRetryInterval < c.RetryInterval:
		return fmt.Errorf("outbox: RelayConfig.MaxRetryInterval must be >= RetryInterval (%v), got %v", c.RetryInterval, c.MaxRetryInterval)
	case c.MaxAttempts < 1:
		return fmt.Errorf("outbox: RelayConfig.MaxAttempts must be >= 1, got %d", c.MaxAttempts)
	case c.HeartbeatInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.HeartbeatInterval must be > 0, got %v", c.HeartbeatInterval)
	case c.CloseTimeout <= 0:
		return fmt.Errorf("outbox: RelayConfig.CloseTimeout must be > 0, got %v", c.CloseTimeout)
	}
	return nil
}

// Relay forwards committed outbox rows to the real publisher. It keeps no
// position in the table: every row carries its own forwarded mark, and a
// relay transaction claims the oldest unmarked rows it can lock (FOR UPDATE
// SKIP LOCKED on PostgreSQL and MySQL; SQLite has one writer), publishes
// them and commits their mark. A row committed late, after rows with higher
// offsets were forwarded, is still unmarked and is forwarded by the next
// batch: no row can be passed over for good.
//
// A row is marked after the publisher accepted it, in the same transaction
// that claimed it; a relay that dies in between leaves the row unmarked and
// it is forwarded again, so downstream consumers must dedupe (settle's dedupe
// middleware does). Several relays can run at once: they lock different rows.
//
// The relay wakes when a row is committed: on PostgreSQL through
// LISTEN/NOTIFY (the outbox's INSERT queues a notification that the server
// delivers only on commit; the relay holds one connection of the pool for
// LISTEN, so the pool must allow at least two), in this process through
// Outbox.Notify, and otherwise at its PollInterval.
type Relay struct {
	o   *core
	cfg RelayConfig
	out message.Publisher // traced
	id  string

	wake    chan struct{}
	busy    chan struct{} // holds a token while a batch runs (see Drain)
	running chan struct{}
	closing chan struct{}
	done    chan struct{}
	started atomic.Bool
	once    sync.Once

	attrs  metric.MeasurementOption
	reg    metric.Registration
	fwdCnt metric.Int64Counter
	fail   metric.Int64Counter

	forwarded atomic.Int64
	failed    atomic.Int64

	health health // the loop's only
	// overran is the offset of the row whose publish outlived the last
	// batch, or 0: the next batch passes over it (the loop's only).
	overran int64

	// lastBeat is when the relay last renewed its heartbeat, polled when
	// its LISTEN connection last polled (see pollIdle); Unix nanoseconds.
	lastBeat atomic.Int64
	polled   atomic.Int64
}

// ErrUnconfirmedPublisher is wrapped by the error NewRelay and Forward
// return for a watermill-amqp Publisher whose
// configuration has neither Publish.ConfirmDelivery nor
// Publish.Transactional: it returns before RabbitMQ has stored a message, so
// a row lost on the way would be marked forwarded, and gone.
var ErrUnconfirmedPublisher = errors.New("outbox: the relay's publisher does not wait for the broker's confirmation (watermill-amqp: set Publish.ConfirmDelivery = true)")

// errReturnsUnseen is logged when a relay is built on watermill-amqp's
// Publisher.
var errReturnsUnseen = errors.New("watermill-amqp's Publisher does not listen for basic.return, and RabbitMQ confirms a message it routed nowhere")

// NewRelay returns a relay from the outbox to out, on the outbox's
// database. It touches no database until Run. The relay does not own the
// database or out: closing the relay leaves them open.
//
// A row is marked forwarded once out.Publish returns nil, so Publish must
// return only when the broker has stored the message. On RabbitMQ use
// amqpsub.Publisher, which also fails a row the broker routed to no queue
// (amqpsub.ErrUnroutable): the row is then retried and set aside like any
// refused row. A watermill-amqp Publisher must have Publish.ConfirmDelivery
// (or Publish.Transactional) set, and one without is refused
// (ErrUnconfirmedPublisher); one with it is accepted, with an error logged
// when the relay is built: it reports a row RabbitMQ routed nowhere as
// published, and the row is marked forwarded. A publisher wrapped in another
// type is not looked into.
func (o *Outbox[TTx]) NewRelay(out message.Publisher, cfg RelayConfig) (*Relay, error) {
	if out == nil {
		return nil, errors.New("outbox: NewRelay: out is nil")
	}
	return o.c.newRelay(out, cfg)
}

func (o *core) newRelay(out message.Publisher, cfg RelayConfig) (*Relay, error) {
	if amqpcheck.Unconfirmed(out) {
		return nil, fmt.Errorf("outbox: NewRelay: out: %w", ErrUnconfirmedPublisher)
	}
	cfg.setDefaults(o)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if amqpcheck.WatermillAMQP(out) {
		cfg.Logger.Error("outbox: relaying through watermill-amqp's Publisher: a row that RabbitMQ routes to no queue cannot be detected, "+
			"and it would be marked forwarded; relay with amqpsub.NewPublisher", errReturnsUnseen,
			watermill.LogFields{"table": o.q.table})
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	r := &Relay{
		o: o, cfg: cfg, out: o.traced(out), id: hex.EncodeToString(b[:]),
		wake: make(chan struct{}, 1), busy: make(chan struct{}, 1), running: make(chan struct{}),
		closing: make(chan struct{}), done: make(chan struct{}),
	}
	if err := r.instruments(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Relay) instruments() error {
	meter := r.o.tel.MeterProvider.Meter(telemetry.OutboxScope)
	var err error
	attrs := attribute.NewSet(attribute.String("settle.outbox.topic", r.o.cfg.Topic))
	r.attrs = metric.WithAttributeSet(attrs)
	if r.fwdCnt, err = meter.Int64Counter("settle.outbox.forwarded", metric.WithDescription("Outbox messages published to the broker."), metric.WithUnit("{message}")); err != nil {
		return err
	}
	if r.fail, err = meter.Int64Counter("settle.outbox.failed", metric.WithDescription("Failed publishes of outbox rows, one per row and attempt, and foreign rows sent to the poison topic."), metric.WithUnit("{message}")); err != nil {
		return err
	}
	pending, err := meter.Int64ObservableGauge("settle.outbox.pending", metric.WithDescription("Committed outbox messages not yet forwarded."), metric.WithUnit("{message}"))
	if err != nil {
		return err
	}
	lag, err := meter.Float64ObservableGauge("settle.outbox.lag", metric.WithDescription("Age of the oldest outbox message not yet forwarded."), metric.WithUnit("s"))
	if err != nil {
		return err
	}
	aside, err := meter.Int64ObservableGauge("settle.outbox.set_aside", metric.WithDescription("Outbox messages set aside after repeated failures, waiting for a person."), metric.WithUnit("{message}"))
	if err != nil {
		return err
	}
	r.reg, err = meter.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		st, err := r.o.status(ctx)
		if err != nil {
			return err
		}
		obs.ObserveInt64(pending, st.Pending, metric.WithAttributeSet(attrs))
		obs.ObserveFloat64(lag, st.Lag.Seconds(), metric.WithAttributeSet(attrs))
		obs.ObserveInt64(aside, st.SetAside, metric.WithAttributeSet(attrs))
		return nil
	}, pending, lag, aside)
	return err
}

// Run forwards until ctx is cancelled or Close is called, and returns nil
// then. A relay runs once: a second Run returns an error; Run after Close
// returns nil at once, without a statement.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: relay: Run called twice")
	}
	defer close(r.done)
	select {
	case <-r.closing:
		// Closed before it ran (Close closes closing before it reads
		// started, so a Close that did not wait for this Run is seen).
		return nil
	default:
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		select {
		case <-r.closing:
			cancel()
		case <-ctx.Done():
		}
	})
	r.o.addWaker(r.wake)
	defer r.o.removeWaker(r.wake)
	var listening sync.WaitGroup
	switch n := r.o.db.MaxConns(); {
	case r.o.q.d != sqldb.Postgres:
	case n > 0 && n < 2:
		r.cfg.Logger.Info("outbox: db allows one connection, which LISTEN would hold for good: the relay polls", nil)
	default:
		// Waited for below, before unregister: its poll may carry a
		// heartbeat that must not land after unregister's delete.
		listening.Go(func() { r.listen(ctx) })
	}
	r.register(ctx)
	defer r.unregister()
	close(r.running)
	r.loop(ctx)
	cancel()
	listening.Wait()
	return nil
}

// Running is closed once the relay is forwarding.
func (r *Relay) Running() chan struct{} { return r.running }

// Close stops the relay, waits (up to CloseTimeout) for the batch in
// progress, and releases its metric callback. The database and the output
// publisher stay open.
func (r *Relay) Close() error {
	var err error
	r.once.Do(func() {
		close(r.closing)
		if r.started.Load() {
			select {
			case <-r.done:
			case <-time.After(r.cfg.CloseTimeout):
				err = fmt.Errorf("outbox: relay did not stop within CloseTimeout %v", r.cfg.CloseTimeout)
			}
		}
		err = errors.Join(err, r.reg.Unregister())
	})
	return err
}

// Counts returns how many rows this relay forwarded and how many publishes
// of a row failed (one per failing row and attempt; a foreign row sent to
// the poison topic counts too) since it was built.
func (r *Relay) Counts() (forwarded, failed int64) {
	return r.forwarded.Load(), r.failed.Load()
}

// Drain waits until no committed row is pending (forwarded by this relay or
// another one, or set aside: a row waiting for its next attempt is still
// pending) and this relay's batch in progress, if any, has ended, so
// that Counts includes every row this relay forwarded. Tests and tools use
// it instead of sleeping.
func (r *Relay) Drain(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		st, err := r.o.status(ctx)
		if err != nil {
			return err
		}
		if st.Pending == 0 {
			// The rows' marks are committed, but the batch that wrote
			// them may not have counted them yet: wait for it.
			select {
			case r.busy <- struct{}{}:
				<-r.busy
				return nil
			case <-ctx.Done():
				return fmt.Errorf("outbox: drain: waiting for the relay's batch: %w", ctx.Err())
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("outbox: drain: %d rows still pending: %w", st.Pending, ctx.Err())
		case <-t.C:
		}
	}
}

// signal wakes the relay's loop; a wake-up already pending absorbs it.
func (r *Relay) signal() { poke(r.wake) }

// loop claims batches while they come back full, then waits for a wake-up
// or the poll tick. A tick asks, in one statement, whether anything is
// pending (an idle relay costs one statement per PollInterval), and carries
// the heartbeat: folded into that statement on PostgreSQL. On MySQL and
// SQLite the heartbeat takes the place of the poll when the poll before
// found nothing, and never of two polls in a row (a heartbeat of its own
// and a poll otherwise): an idle relay sends one statement per
// PollInterval there too, and a row no wake-up announced (committed by
// another process, or waiting for its retry) may wait a PollInterval
// more, once every HeartbeatInterval. While the LISTEN connection polls (see
// pollIdle), the tick sends nothing.
func (r *Relay) loop(ctx context.Context) {
	tick := time.NewTicker(r.idlePoll())
	defer tick.Stop()
	r.lastBeat.Store(time.Now().UnixNano()) // register beat
	claim := true
	quiet := false // the last poll of the tick found nothing pending
	for ctx.Err() == nil {
		if claim && r.beatDue() {
			// Batches that keep coming (a backlog, or failures retried
			// after RetryInterval) never reach the tick below: beat here,
			// so that Status counts a busy or failing relay as alive.
			if _, err := r.probe(ctx, r.o.db.DB(), true); err != nil && ctx.Err() == nil {
				r.cfg.Logger.Error("outbox: relay heartbeat failed", err, nil)
			}
		}
		if claim {
			res, err := r.batch(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				err = r.o.schemaHint(context.WithoutCancel(ctx), err)
				r.cfg.Logger.Error("outbox: relay batch failed; retrying", err, watermill.LogFields{"retry_in": r.cfg.RetryInterval})
				if !settlement.Sleep(ctx, r.cfg.RetryInterval) {
					return
				}
				continue
			}
			if res.stopped || (len(res.failed) > 0 && len(res.published) == 0) {
				// Nothing went through: the broker may be down. The
				// failed rows wait for their next attempt; pause.
				if res.stopped {
					r.cfg.Logger.Info("outbox: two publishes failed in a row; pausing the relay", watermill.LogFields{"retry_in": r.cfg.RetryInterval})
				}
				if !settlement.Sleep(ctx, r.cfg.RetryInterval) {
					return
				}
				continue
			}
			if res.more(r.cfg) {
				continue
			}
			claim = false
		}
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
			claim = true
			quiet = false
		case <-tick.C:
			if time.Since(time.Unix(0, r.polled.Load())) < 2*r.idlePoll() {
				continue // the LISTEN connection polls
			}
			beat := r.beatDue()
			if beat && quiet && r.o.q.probeBeat == "" {
				quiet = false // the next tick polls
				// Bounded, not cancelled, as probe's heartbeat.
				bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.AckDeadline)
				err := r.heartbeat(bctx, r.o.db.DB())
				cancel()
				if err != nil && ctx.Err() == nil {
					r.cfg.Logger.Error("outbox: relay heartbeat failed", err, nil)
				}
				continue
			}
			pending, err := r.probe(ctx, r.o.db.DB(), beat)
			quiet = err == nil && !pending
			if err != nil {
				if ctx.Err() == nil {
					r.cfg.Logger.Error("outbox: relay poll failed", err, nil)
				}
				continue
			}
			claim = pending
		}
	}
}

// pollIdle is the poll of a relay whose LISTEN connection is in place, run
// on that connection between two waits for a notification, every
// PollInterval: there it is the one statement of the poll, where the pool
// would add a health-check ping before it (pgx's pool and database/sql
// over pgx ping a connection idle for over a second, which a connection
// used once per PollInterval of 1 s often is). It wakes the loop when rows
// are pending.
func (r *Relay) pollIdle(ctx context.Context, ex sqldb.Executor) {
	pending, err := r.probe(ctx, ex, r.beatDue())
	if err != nil {
		if ctx.Err() == nil {
			r.cfg.Logger.Error("outbox: relay poll failed", err, nil)
		}
		return
	}
	r.polled.Store(time.Now().UnixNano())
	if pending {
		r.signal()
	}
}

// idlePoll is how often an idle relay polls: every PollInterval, or every
// HeartbeatInterval when that is shorter, since the idle relay's heartbeat
// rides on its polls. (Polls of a PollInterval longer than three
// heartbeat intervals left an idle relay counted dead by Status for most
// of each: TestIdleRelayBeatsEveryHeartbeatInterval.)
func (r *Relay) idlePoll() time.Duration { return min(r.cfg.PollInterval, r.cfg.HeartbeatInterval) }

// beatDue reports whether the relay's heartbeat is due.
func (r *Relay) beatDue() bool {
	return time.Since(time.Unix(0, r.lastBeat.Load())) >= r.cfg.HeartbeatInterval
}

// ttl is how long a heartbeat keeps the relay alive in Status.
func (r *Relay) ttl() time.Duration { return 3 * r.cfg.HeartbeatInterval }

// beatArg is the heartbeat's time-to-live in the unit of the dialect's
// statement: seconds, or microseconds on MySQL.
func (r *Relay) beatArg() any {
	if r.o.q.d == sqldb.MySQL {
		return r.ttl().Microseconds()
	}
	return r.ttl().Seconds()
}

// probe asks, on ex, whether any row is pending, and with beat renews the
// relay's heartbeat: in the same statement on PostgreSQL, in one statement
// more on MySQL and SQLite, which cannot write the heartbeat and read the
// answer in one statement (there the loop lets a heartbeat take the place
// of a poll of an idle relay instead; see loop).
//
// A heartbeat is not cancelled by Close: a write the client gave up on may
// still land on the server after unregister's delete, and leave the relay
// looking alive for a heartbeat's lifetime after it stopped.
func (r *Relay) probe(ctx context.Context, ex sqldb.Executor, beat bool) (bool, error) {
	if beat {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), r.cfg.AckDeadline)
		defer cancel()
	}
	if beat && r.o.q.probeBeat == "" {
		if err := r.heartbeat(ctx, ex); err != nil {
			return false, err
		}
		beat = false
	}
	q, args := r.o.q.probe, []any(nil)
	if beat {
		q, args = r.o.q.probeBeat, []any{r.id, r.beatArg()}
	}
	var pending bool
	if err := ex.QueryRow(ctx, q, args, &pending); err != nil {
		return false, err
	}
	if beat {
		r.lastBeat.Store(time.Now().UnixNano())
	}
	return pending, nil
}

// heartbeat renews the relay's heartbeat on ex, in a statement of its own.
// The caller bounds ctx (see probe).
func (r *Relay) heartbeat(ctx context.Context, ex sqldb.Executor) error {
	if _, err := ex.Exec(ctx, r.o.q.beat, r.id, r.beatArg()); err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	r.lastBeat.Store(time.Now().UnixNano())
	return nil
}

// register writes the relay's first heartbeat and sweeps relays expired
// long ago. Failures are logged: the heartbeat is retried by the polls.
func (r *Relay) register(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.AckDeadline) // as probe's heartbeat
	defer cancel()
	if _, err := r.o.db.DB().Exec(ctx, r.o.q.beat, r.id, r.beatArg()); err != nil {
		r.cfg.Logger.Error("outbox: relay heartbeat failed", err, nil)
		return
	}
	if _, err := r.o.db.DB().Exec(ctx, r.o.q.sweep); err != nil {
		r.cfg.Logger.Error("outbox: sweeping expired relays failed", err, nil)
	}
}

func (r *Relay) unregister() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := r.o.db.DB().Exec(ctx, r.o.q.forget, r.id); err != nil {
		r.cfg.Logger.Info("outbox: relay could not remove its heartbeat", watermill.LogFields{"err": err.Error()})
	}
}

// row is one claimed outbox row.
type row struct {
	offset   int64
	uuid     string
	topic    string
	payload  []byte
	metadata string
	age      float64
	attempts int
	size     int64
}

// failure is one failed publish of one row in a batch.
type failure struct {
	rw  row
	err error
}

// batchResult is what one batch did with the rows it claimed.
type batchResult struct {
	claimed   int
	bytes     int64
	published []row // to their topic, or foreign ones to the poison topic
	poisoned  int   // of published, foreign rows
	failed    []failure
	released  []row    // not tried, or tried right after another failure: pending again, untouched
	stopped   bool     // a publish failed right after another: the broker may be down
	overrun   *failure // the publish in flight when the batch overran its AckDeadline
}

// more reports whether rows may be ready beyond those the batch took.
func (b batchResult) more(cfg RelayConfig) bool {
	return b.claimed == cfg.BatchSize || len(b.released) > 0 || b.bytes > cfg.BatchBytes/2
}

// batch claims up to BatchSize rows (and BatchBytes), publishes them in
// offset order and commits what became of each: forwarded, failed (its
// attempt counted, its next attempt delayed, or set aside), or released
// untouched. A failed row does not stop the batch: the rows behind it are
// published, one call per row from there on, skipping the other rows of a
// topic that failed. A publish that fails right after another one stops
// it (the broker may be down): that row and the rest are released.
//
// Closing the relay (ctx ending) stops the batch before its claim or
// between two publishes, but the marks of the rows already published are
// still written and committed, within the batch's AckDeadline: a relay
// stopped mid-batch does not publish them twice.
func (r *Relay) batch(ctx context.Context) (batchResult, error) {
	r.busy <- struct{}{}
	defer func() { <-r.busy }()
	ctx, cancel := context.WithTimeout(ctx, r.cfg.AckDeadline)
	defer cancel()
	deadline, _ := ctx.Deadline()
	txCtx, txCancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer txCancel()
	var opts *sql.TxOptions
	if r.o.q.d != sqldb.SQLite {
		// Row locks only: no gap locks on MySQL that would stall writers.
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	setup := ""
	if r.o.q.d == sqldb.Postgres {
		// The marks need not wait for the WAL flush: a mark lost in a
		// crash means the rows are published again, the duplicate the
		// relay allows anyway. The next batch does not wait for the disk.
		setup = "SET LOCAL synchronous_commit = off"
	}
	var res batchResult
	tx, err := r.o.db.begin(txCtx, opts, setup)
	if err != nil {
		return res, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.rollback(txCtx) }()
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	rows, err := r.claim(ctx, tx)
	if err != nil {
		return res, fmt.Errorf("claim: %w", err)
	}
	res.claimed = len(rows)
	if len(rows) == 0 {
		return res, tx.commit(txCtx)
	}
	for _, rw := range rows {
		res.bytes += rw.size
	}
	skip := r.overran
	r.overran = 0
	r.publish(ctx, rows, skip, &res)
	if res.overrun != nil {
		r.overran = res.overrun.rw.offset
		_ = tx.rollback(txCtx)
		return batchResult{}, r.recordOverrun(*res.overrun)
	}
	if err := r.settle(txCtx, tx, &res); err != nil {
		return batchResult{}, err
	}
	if err := tx.commit(txCtx); err != nil {
		return batchResult{}, fmt.Errorf("commit: %w", err)
	}
	fwd := int64(len(res.published) - res.poisoned)
	r.forwarded.Add(fwd)
	r.fwdCnt.Add(txCtx, fwd, r.attrs)
	r.failed.Add(int64(len(res.failed)))
	r.fail.Add(txCtx, int64(len(res.failed)), r.attrs)
	r.logFailures(res)
	return res, nil
}

// settle writes, in the batch's transaction, what became of each row.
func (r *Relay) settle(ctx context.Context, tx txn, res *batchResult) error {
	if r.o.q.claimMarks {
		if len(res.released) > 0 {
			if _, err := tx.Exec(ctx, r.o.q.mark(len(res.released), false), offsets(res.released)...); err != nil {
				return fmt.Errorf("unmark: %w", err)
			}
		}
	} else if len(res.published) > 0 {
		if _, err := tx.Exec(ctx, r.o.q.mark(len(res.published), true), offsets(res.published)...); err != nil {
			return fmt.Errorf("mark: %w", err)
		}
	}
	for i, f := range res.failed {
		aside := r.health.setAside(f.rw.offset, f.rw.topic, f.rw.attempts+1, r.cfg.MaxAttempts)
		delay := r.backoff(f.rw.attempts + 1)
		if aside {
			delay = 0
			r.health.forget(f.rw.offset)
		}
		res.failed[i].rw.attempts++ // now the row's count
		if aside {
			res.failed[i].rw.age = -1 // marks it set aside for logFailures
		}
		if _, err := tx.Exec(ctx, r.o.q.fail, r.failArgs(errorText(f.err), delay, aside, f.rw.offset)...); err != nil {
			return fmt.Errorf("record the failure of row %d: %w", f.rw.offset, err)
		}
	}
	return nil
}

// recordOverrun counts the failure of the row whose publish outlived the
// batch, in a statement of its own: the batch was rolled back, and its
// other rows are pending again (those it had published go out twice).
func (r *Relay) recordOverrun(f failure) error {
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.AckDeadline)
	defer cancel()
	res := batchResult{failed: []failure{f}}
	tx, err := r.o.db.begin(ctx, nil, "")
	if err != nil {
		return errors.Join(f.err, fmt.Errorf("record the failure: %w", err))
	}
	defer func() { _ = tx.rollback(ctx) }()
	if err := r.settle(ctx, tx, &res); err != nil {
		return errors.Join(f.err, err)
	}
	if err := tx.commit(ctx); err != nil {
		return errors.Join(f.err, fmt.Errorf("record the failure: %w", err))
	}
	r.failed.Add(1)
	r.fail.Add(ctx, 1, r.attrs)
	r.logFailures(res)
	return fmt.Errorf("batch rolled back: %w", f.err)
}

func (r *Relay) failArgs(text string, delay time.Duration, aside bool, offset int64) []any {
	a := 0
	if aside {
		a = 1
	}
	if r.o.q.d == sqldb.MySQL {
		return []any{text, a, delay.Microseconds(), a, offset}
	}
	return []any{text, delay.Seconds(), a, offset}
}

// backoff is the delay before the next attempt of a row that has failed
// attempts times: RetryInterval doubled at each failure after the first, up
// to MaxRetryInterval, within ±10% so that rows that failed together are
// not retried together.
func (r *Relay) backoff(attempts int) time.Duration {
	d := r.cfg.RetryInterval
	for i := 1; i < attempts && d < r.cfg.MaxRetryInterval; i++ {
		d *= 2
	}
	d = min(d, r.cfg.MaxRetryInterval)
	return time.Duration(float64(d) * (0.9 + 0.2*mrand.Float64()))
}

func (r *Relay) logFailures(res batchResult) {
	for _, f := range res.failed {
		fields := watermill.LogFields{"offset": f.rw.offset, "uuid": f.rw.uuid, "topic": f.rw.topic, "attempts": f.rw.attempts}
		if f.rw.age < 0 {
			r.cfg.Logger.Error("outbox: publishing a row failed for the last time: set aside (settle outbox status lists it, settle outbox retry re-queues it)", f.err, fields)
			continue
		}
		r.cfg.Logger.Error("outbox: publishing a row failed; it will be retried", f.err, fields)
	}
}

func offsets(rows []row) []any {
	out := make([]any, len(rows))
	for i, rw := range rows {
		out[i] = rw.offset
	}
	return out
}

func (r *Relay) claim(ctx context.Context, tx txn) ([]row, error) {
	if r.o.q.d == sqldb.MySQL {
		return r.claimMySQL(ctx, tx)
	}
	var out []row
	err := tx.Query(ctx, r.o.q.claim, []any{r.cfg.BatchSize, r.cfg.BatchBytes}, func(scan func(...any) error) error {
		var rw row
		var age sql.NullFloat64
		if err := scan(&rw.offset, &rw.uuid, &rw.topic, &rw.payload, &rw.metadata, &age, &rw.attempts); err != nil {
			return err
		}
		rw.age = age.Float64
		rw.size = int64(len(rw.payload) + len(rw.metadata))
		out = append(out, rw)
		return nil
	})
	if err != nil {
		return nil, err
	}
	// RETURNING has no order: forward in offset order.
	slices.SortFunc(out, func(a, b row) int { return cmp.Compare(a.offset, b.offset) })
	return out, nil
}

// claimMySQL locks the next rows, reading only their sizes, and reads the
// rows that fit the byte bound; the others stay locked until the batch
// commits, and pending.
func (r *Relay) claimMySQL(ctx context.Context, tx txn) ([]row, error) {
	var heads []row
	var total int64
	err := tx.Query(ctx, r.o.q.claim, []any{r.cfg.BatchSize}, func(scan func(...any) error) error {
		var rw row
		if err := scan(&rw.offset, &rw.size, &rw.attempts); err != nil {
			return err
		}
		if len(heads) > 0 && total+rw.size > r.cfg.BatchBytes {
			return nil // read to the end: the statement must finish
		}
		total += rw.size
		heads = append(heads, rw)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(heads) == 0 {
		return nil, nil
	}
	byOffset := make(map[int64]*row, len(heads))
	for i := range heads {
		byOffset[heads[i].offset] = &heads[i]
	}
	q := r.o.q.fetch + "(" + strings.TrimSuffix(strings.Repeat("?, ", len(heads)), ", ") + ")"
	err = tx.Query(ctx, q, offsets(heads), func(scan func(...any) error) error {
		var rw row
		var age sql.NullFloat64
		if err := scan(&rw.offset, &rw.uuid, &rw.topic, &rw.payload, &rw.metadata, &age); err != nil {
			return err
		}
		h := byOffset[rw.offset]
		if h == nil {
			return nil
		}
		h.uuid, h.topic, h.payload, h.metadata, h.age = rw.uuid, rw.topic, rw.payload, rw.metadata, age.Float64
		h.size = int64(len(rw.payload) + len(rw.metadata))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return heads, nil
}

// publish publishes rows in offset order into res: consecutive rows of one
// topic in one call until a publish fails, then one row per call. The row
// at offset skip, whose publish outlived the batch before, is released
// untried: otherwise, due again after a backoff no longer than the pause
// after that batch, it would be first in this one too, overrun it, and the
// rows behind it would never be published (nor would it be set aside,
// which waits for the relay to publish some other row). A row
// whose own publish fails is recorded as failed and the batch goes on with
// the rows behind it, passing over (releasing) the other rows of that topic
// in this batch; a failure right after it stops the batch and is nobody's
// (the next batch starts with that row). A publish that
// fails with several rows is not the failure of any one of them: they are
// tried again one by one (rows the failed call had already published go out
// twice, a duplicate the relay allows).
func (r *Relay) publish(ctx context.Context, rows []row, skip int64, res *batchResult) {
	careful := false
	failedTopics := map[string]bool{}
	consecutive := 0
	for i := 0; i < len(rows); {
		if ctx.Err() != nil { // closing: the rest stay pending
			res.released = append(res.released, rows[i:]...)
			return
		}
		rw := rows[i]
		if failedTopics[rw.topic] || rw.offset == skip {
			res.released = append(res.released, rw)
			i++
			continue
		}
		m, ok := r.message(ctx, rw)
		if !ok { // foreign: its metadata does not decode
			if err := r.poison(rw); err != nil {
				if ctx.Err() != nil || consecutive > 0 {
					res.released = append(res.released, rows[i:]...)
					res.stopped = ctx.Err() == nil
					return
				}
				r.recordFailure(res, rw, err)
				consecutive++
				careful = true
			} else {
				r.health.success(rw.offset, r.cfg.PoisonTopic)
				res.published = append(res.published, rw)
				res.poisoned++
				r.failed.Add(1)
				r.fail.Add(context.WithoutCancel(ctx), 1, r.attrs)
				consecutive = 0
			}
			i++
			continue
		}
		msgs := []*message.Message{m}
		end := i + 1
		for !careful && end < len(rows) && rows[end].topic == rw.topic && rows[end].offset != skip {
			m, ok := r.message(ctx, rows[end])
			if !ok {
				break
			}
			msgs = append(msgs, m)
			end++
		}
		err := r.out.Publish(rw.topic, msgs...)
		if err == nil {
			for _, p := range rows[i:end] {
				r.health.success(p.offset, p.topic)
			}
			res.published = append(res.published, rows[i:end]...)
			consecutive = 0
			i = end
			continue
		}
		if ctx.Err() != nil {
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				// The batch overran its AckDeadline (not a Close): its
				// transaction is gone with it, and the row that did not
				// return would be first in the next batch again.
				r.health.failure(rw.offset, rw.topic)
				res.overrun = &failure{rw: rw, err: fmt.Errorf("publish to %q did not return within the batch's AckDeadline (%v): %w", rw.topic, r.cfg.AckDeadline, err)}
			}
			res.released = append(res.released, rows[i:]...)
			return
		}
		if len(msgs) > 1 {
			careful = true // find the row that fails
			continue
		}
		if consecutive > 0 {
			// Right after another failure: the broker may refuse
			// everything now (or be reconnecting after the row before).
			// Not this row's failure; stop and try again later.
			r.cfg.Logger.Debug("outbox: a second publish failed in a row; pausing", watermill.LogFields{"offset": rw.offset, "topic": rw.topic, "err": err.Error()})
			res.released = append(res.released, rows[i:]...)
			res.stopped = true
			return
		}
		r.recordFailure(res, rw, fmt.Errorf("publish to %q: %w", rw.topic, err))
		failedTopics[rw.topic] = true
		careful = true
		consecutive++
		i++
	}
}

func (r *Relay) recordFailure(res *batchResult, rw row, err error) {
	r.health.failure(rw.offset, rw.topic)
	res.failed = append(res.failed, failure{rw: rw, err: err})
}

func (r *Relay) message(ctx context.Context, rw row) (*message.Message, bool) {
	md, err := decodeMetadata(rw.metadata)
	if err != nil {
		return nil, false
	}
	m := message.NewMessage(rw.uuid, rw.payload)
	m.Metadata = md
	m.SetContext(ctx)
	return m, true
}

func (r *Relay) poison(rw row) error {
	r.cfg.Logger.Error("outbox: row's metadata is neither a JSON object of strings nor settle's base64 form; publishing it to the poison topic", nil, watermill.LogFields{
		"offset": rw.offset, "uuid": rw.uuid, "poison_topic": r.cfg.PoisonTopic,
	})
	m := message.NewMessage(rw.uuid, rw.payload)
	m.Metadata.Set("settle_outbox_topic", rw.topic)
	m.Metadata.Set("settle_outbox_metadata", rw.metadata)
	if err := r.out.Publish(r.cfg.PoisonTopic, m); err != nil {
		return fmt.Errorf("row %d is foreign, and publishing it to %q failed: %w", rw.offset, r.cfg.PoisonTopic, err)
	}
	return nil
}

// health is what the relay has seen of the broker, to tell a row or a
// topic the broker refuses from a broker that refuses everything. Only the
// relay's loop uses it (batches run one at a time).
type health struct {
	seq   uint64
	okSeq uint64 // the last successful publish
	// ok and other are the last successful publish and the last one to
	// another topic than ok's.
	ok, other topicMark
	first     map[int64]uint64  // the first failure this relay saw of each row still failing
	failing   map[string]uint64 // the first failure of each topic since it last took a publish
}

type topicMark struct {
	topic string
	seq   uint64
}

// maxTracked bounds health's maps; past it the relay forgets what it saw
// (rows then take longer to be set aside, never less long).
const maxTracked = 100_000

func (h *health) success(offset int64, topic string) {
	h.seq++
	h.okSeq = h.seq
	if h.ok.topic != topic {
		h.other = h.ok
	}
	h.ok = topicMark{topic: topic, seq: h.seq}
	delete(h.first, offset)
	delete(h.failing, topic)
}

func (h *health) failure(offset int64, topic string) {
	h.seq++
	if h.first == nil || len(h.first) >= maxTracked {
		h.first = map[int64]uint64{}
	}
	if h.failing == nil || len(h.failing) >= maxTracked {
		h.failing = map[string]uint64{}
	}
	if _, ok := h.first[offset]; !ok {
		h.first[offset] = h.seq
	}
	if _, ok := h.failing[topic]; !ok {
		h.failing[topic] = h.seq
	}
}

// setAside decides whether the row at offset, to topic, is set aside after
// attempts failed publishes: after max of them, once the broker has shown
// that it works and refuses this row (it took some other row after this
// row's first failure) or this topic (it took a row to another topic after
// this topic began to fail). A broker that takes nothing sets nothing
// aside.
func (h *health) setAside(offset int64, topic string, attempts, max int) bool {
	if attempts < max {
		return false
	}
	if f, ok := h.first[offset]; ok && h.okSeq > f {
		return true
	}
	other := h.ok
	if other.topic == topic {
		other = h.other
	}
	f, ok := h.failing[topic]
	return ok && other.seq > f
}

func (h *health) forget(offset int64) { delete(h.first, offset) }

// maxErrorText bounds the error text stored with a failed row.
const maxErrorText = 1000

var credentials = regexp.MustCompile(`(?i)([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@`)

// errorText is err's text as stored in the row: credentials in URLs
// redacted, valid UTF-8 without NUL (PostgreSQL's text refuses it), at most
// maxErrorText bytes.
func errorText(err error) string {
	s := credentials.ReplaceAllString(err.Error(), "${1}xxxxx@")
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\\x00")
	if len(s) > maxErrorText {
		cut := maxErrorText
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

// listen holds one connection of the pool in LISTEN on the outbox's channel and
// wakes the relay on each notification, and once after each (re)connect
// for the commits it may have missed.
//
// A connection lost after it had LISTENed for a PollInterval (the server
// ended it: pg_terminate_backend, a restart, a proxy) is replaced at once,
// so that the commits made meanwhile wait for no RetryInterval; one lost
// sooner, or a connect that failed, is tried again after RetryInterval.
// Meanwhile the loop polls on the pool.
func (r *Relay) listen(ctx context.Context) {
	for {
		var since atomic.Int64 // when the LISTEN was in place, Unix nanoseconds
		wake := func() {
			since.CompareAndSwap(0, time.Now().UnixNano())
			r.signal()
		}
		err := r.o.db.Listen(ctx, r.o.q.qTable, wake, r.idlePoll(), r.pollIdle)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errors.ErrUnsupported) {
			r.cfg.Logger.Info("outbox: "+err.Error(), nil)
			return
		}
		wait := r.cfg.RetryInterval
		if s := since.Load(); s != 0 && time.Since(time.Unix(0, s)) >= r.cfg.PollInterval {
			wait = 0
		}
		r.cfg.Logger.Error("outbox: LISTEN connection lost; polling until it is back", err, watermill.LogFields{"retry_in": wait})
		if !settlement.Sleep(ctx, wait) {
			return
		}
	}
}

// Forward forwards every committed row now and returns when the outbox is
// drained: a relay on demand, for tests, tools and cron jobs. It returns the
// number of rows it forwarded.
func (o *Outbox[TTx]) Forward(ctx context.Context, out message.Publisher, cfg RelayConfig) (int64, error) {
	r, err := o.NewRelay(out, cfg)
	if err != nil {
		return 0, err
	}
	return forward(ctx, r)
}

// forward runs r until the outbox is drained.
func forward(ctx context.Context, r *Relay) (int64, error) {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	<-r.Running()
	derr := r.Drain(ctx)
	cerr := r.Close()
	rerr := <-done
	n, _ := r.Counts()
	return n, errors.Join(derr, cerr, rerr)
}
