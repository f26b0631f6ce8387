package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/settle-go/settle/dedupe"
)

// ScopeName is the OpenTelemetry instrumentation scope of the outbox's
// metrics and spans.
const ScopeName = "github.com/settle-go/settle/outbox"

// MaxBatchSize is the largest RelayConfig.BatchSize.
const MaxBatchSize = 1000

// RelayConfig configures a Relay.
type RelayConfig struct {
	// PollInterval is how often an idle relay looks for committed rows
	// nobody told it about: the fallback behind PostgreSQL's LISTEN/NOTIFY
	// and Outbox.Notify, and the lag of a row committed by another process
	// on MySQL and SQLite. Each poll is one statement. Defaults to 1s. Must
	// be > 0.
	PollInterval time.Duration
	// BatchSize is the most rows one relay transaction claims and
	// forwards. Defaults to 100. Must be 1-MaxBatchSize.
	BatchSize int
	// AckDeadline bounds one batch: claiming its rows, publishing them and
	// committing their forwarded mark. A batch that overruns is rolled back
	// and its rows are forwarded again (a duplicate of those already
	// published). Defaults to 30s, or 5s on SQLite, where the relay holds the
	// database's write lock for the batch and the deadline must stay below the
	// busy timeout of other writers (10s in settle's DSN). Must be > 0.
	AckDeadline time.Duration
	// RetryInterval is how long the relay waits after a failed batch (the
	// broker refused, the database is gone) before trying again, so that an
	// outage is not a hot loop of failing publishes and error logs. Defaults
	// to 1s. Must be > 0.
	RetryInterval time.Duration
	// HeartbeatInterval is how often the relay renews its row in the relays
	// table; Status counts a relay as alive for three intervals after its
	// last heartbeat. Defaults to 10s. Must be > 0.
	HeartbeatInterval time.Duration
	// PoisonTopic receives, unchanged, rows whose metadata is not a JSON
	// object of strings (written by something else into the outbox table),
	// so that they do not block the relay; they are counted as failed and
	// marked forwarded. Defaults to the outbox topic + "_poison".
	PoisonTopic string
	// CloseTimeout bounds Close's wait for the batch in progress. Defaults
	// to 30s. Must be > 0.
	CloseTimeout time.Duration
	// MeterProvider records settle.outbox.forwarded, settle.outbox.failed,
	// settle.outbox.pending and settle.outbox.lag. Defaults to the global
	// provider.
	MeterProvider metric.MeterProvider
	// Logger defaults to the Outbox's logger.
	Logger watermill.LoggerAdapter
}

func (c *RelayConfig) setDefaults(o *Outbox) {
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = 30 * time.Second
		if o.cfg.Dialect == dedupe.SQLite {
			c.AckDeadline = 5 * time.Second
		}
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = time.Second
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
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Logger == nil {
		c.Logger = o.cfg.Logger
	}
}

// Validate reports the first invalid field.
func (c RelayConfig) Validate() error {
	switch {
	case c.PollInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.PollInterval must be > 0, got %v", c.PollInterval)
	case c.BatchSize < 1 || c.BatchSize > MaxBatchSize:
		return fmt.Errorf("outbox: RelayConfig.BatchSize must be 1-%d, got %d", MaxBatchSize, c.BatchSize)
	case c.AckDeadline <= 0:
		return fmt.Errorf("outbox: RelayConfig.AckDeadline must be > 0, got %v", c.AckDeadline)
	case c.RetryInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.RetryInterval must be > 0, got %v", c.RetryInterval)
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
// LISTEN, so db must allow at least two), in this process through
// Outbox.Notify, and otherwise at its PollInterval.
type Relay struct {
	o   *Outbox
	db  conn
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
}

// NewRelay returns a relay from the outbox on db to out. It touches no
// database until Run. The relay does not own db or out: closing the relay
// leaves them open.
func (o *Outbox) NewRelay(db *sql.DB, out message.Publisher, cfg RelayConfig) (*Relay, error) {
	if db == nil || out == nil {
		return nil, errors.New("outbox: NewRelay: db and out are required")
	}
	return o.newRelay(sqlConn(db), out, cfg)
}

func (o *Outbox) newRelay(db conn, out message.Publisher, cfg RelayConfig) (*Relay, error) {
	cfg.setDefaults(o)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	r := &Relay{
		o: o, db: db, cfg: cfg, out: o.traced(out), id: hex.EncodeToString(b[:]),
		wake: make(chan struct{}, 1), busy: make(chan struct{}, 1), running: make(chan struct{}),
		closing: make(chan struct{}), done: make(chan struct{}),
	}
	if err := r.instruments(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Relay) instruments() error {
	meter := r.cfg.MeterProvider.Meter(ScopeName)
	var err error
	attrs := attribute.NewSet(attribute.String("settle.outbox.topic", r.o.cfg.Topic))
	r.attrs = metric.WithAttributeSet(attrs)
	if r.fwdCnt, err = meter.Int64Counter("settle.outbox.forwarded", metric.WithDescription("Outbox messages published to the broker."), metric.WithUnit("{message}")); err != nil {
		return err
	}
	if r.fail, err = meter.Int64Counter("settle.outbox.failed", metric.WithDescription("Outbox forwards that failed and will be retried, and foreign rows set aside."), metric.WithUnit("{message}")); err != nil {
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
	r.reg, err = meter.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		st, err := r.Status(ctx)
		if err != nil {
			return err
		}
		obs.ObserveInt64(pending, st.Pending, metric.WithAttributeSet(attrs))
		obs.ObserveFloat64(lag, st.Lag.Seconds(), metric.WithAttributeSet(attrs))
		return nil
	}, pending, lag)
	return err
}

// Run forwards until ctx is cancelled or Close is called, and returns nil
// then. A relay runs once: a second Run returns an error.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: relay: Run called twice")
	}
	defer close(r.done)
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
	switch n := r.db.maxConns(); {
	case r.o.cfg.Dialect != dedupe.Postgres:
	case n > 0 && n < 2:
		r.cfg.Logger.Info("outbox: db allows one connection, which LISTEN would hold for good: the relay polls", nil)
	default:
		wg.Go(func() { r.listen(ctx) })
	}
	r.register(ctx)
	defer r.unregister()
	close(r.running)
	r.loop(ctx)
	cancel()
	return nil
}

// Running is closed once the relay is forwarding.
func (r *Relay) Running() chan struct{} { return r.running }

// Close stops the relay, waits (up to CloseTimeout) for the batch in
// progress, and releases its metric callback. db and the output publisher
// stay open.
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

// Counts returns how many rows this relay forwarded and how many forwards
// failed (or were foreign rows set aside) since it was built.
func (r *Relay) Counts() (forwarded, failed int64) {
	return r.forwarded.Load(), r.failed.Load()
}

// Status is the outbox's Status.
func (r *Relay) Status(ctx context.Context) (Status, error) {
	return r.o.status(ctx, r.db)
}

// Drain waits until no committed row is pending (forwarded by this relay or
// another one) and this relay's batch in progress, if any, has ended, so
// that Counts includes every row this relay forwarded. Tests and tools use
// it instead of sleeping.
func (r *Relay) Drain(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		st, err := r.Status(ctx)
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

// sleep waits d, or until ctx ends; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// loop claims batches while they come back full, then waits for a wake-up
// or the poll tick. A tick first asks, in one statement, whether anything is
// pending (an idle relay costs one statement per PollInterval) and carries
// the heartbeat on PostgreSQL.
func (r *Relay) loop(ctx context.Context) {
	tick := time.NewTicker(r.cfg.PollInterval)
	defer tick.Stop()
	lastBeat := time.Now()
	claim := true
	for ctx.Err() == nil {
		if claim {
			n, err := r.batch(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				r.cfg.Logger.Error("outbox: relay batch failed; retrying", err, watermill.LogFields{"retry_in": r.cfg.RetryInterval})
				if !sleep(ctx, r.cfg.RetryInterval) {
					return
				}
				continue
			}
			if n == r.cfg.BatchSize {
				continue
			}
			claim = false
		}
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
			claim = true
		case <-tick.C:
			beat := time.Since(lastBeat) >= r.cfg.HeartbeatInterval
			pending, err := r.probe(ctx, beat)
			if err != nil {
				if ctx.Err() == nil {
					r.cfg.Logger.Error("outbox: relay poll failed", err, nil)
				}
				continue
			}
			if beat {
				lastBeat = time.Now()
			}
			claim = pending
		}
	}
}

// ttl is how long a heartbeat keeps the relay alive in Status.
func (r *Relay) ttl() time.Duration { return 3 * r.cfg.HeartbeatInterval }

// beatArg is the heartbeat's time-to-live in the unit of the dialect's
// statement: seconds, or microseconds on MySQL.
func (r *Relay) beatArg() any {
	if r.o.cfg.Dialect == dedupe.MySQL {
		return r.ttl().Microseconds()
	}
	return r.ttl().Seconds()
}

// A heartbeat is not cancelled by Close: a write the client gave up on may
// still land on the server after unregister's delete, and leave the relay
// looking alive for a heartbeat's lifetime after it stopped.
func (r *Relay) probe(ctx context.Context, beat bool) (bool, error) {
	if beat {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), r.cfg.AckDeadline)
		defer cancel()
	}
	q, args := r.o.q.probe, []any(nil)
	if beat {
		if r.o.q.probeBeat != "" {
			q, args = r.o.q.probeBeat, []any{r.id, r.beatArg()}
		} else if _, err := r.db.ExecContext(ctx, r.o.q.beat, r.id, r.beatArg()); err != nil {
			return false, fmt.Errorf("heartbeat: %w", err)
		}
	}
	var pending bool
	if err := queryRow(ctx, r.db, q, args, &pending); err != nil {
		return false, err
	}
	return pending, nil
}

// register writes the relay's first heartbeat and sweeps relays expired
// long ago. Failures are logged: the heartbeat is retried by the polls.
func (r *Relay) register(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.AckDeadline) // as probe's heartbeat
	defer cancel()
	if _, err := r.db.ExecContext(ctx, r.o.q.beat, r.id, r.beatArg()); err != nil {
		r.cfg.Logger.Error("outbox: relay heartbeat failed", err, nil)
		return
	}
	if _, err := r.db.ExecContext(ctx, r.o.q.sweep); err != nil {
		r.cfg.Logger.Error("outbox: sweeping expired relays failed", err, nil)
	}
}

func (r *Relay) unregister() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := r.db.ExecContext(ctx, r.o.q.forget, r.id); err != nil {
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
}

// batch claims up to BatchSize rows, publishes them in offset order and
// commits their forwarded marks. It returns how many rows it claimed. A
// publish that fails stops the batch: the rows from there on are left
// unmarked, to be claimed again after RetryInterval.
//
// Closing the relay (ctx ending) stops the batch before its claim or
// between two publishes, but the marks of the rows already published are
// still written and committed, within the batch's AckDeadline: a relay
// stopped mid-batch does not publish them twice.
func (r *Relay) batch(ctx context.Context) (int, error) {
	r.busy <- struct{}{}
	defer func() { <-r.busy }()
	ctx, cancel := context.WithTimeout(ctx, r.cfg.AckDeadline)
	defer cancel()
	deadline, _ := ctx.Deadline()
	txCtx, txCancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer txCancel()
	var opts *sql.TxOptions
	if r.o.cfg.Dialect != dedupe.SQLite {
		// Row locks only: no gap locks on MySQL that would stall writers.
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	tx, err := r.db.BeginTx(txCtx, opts)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if r.o.cfg.Dialect == dedupe.Postgres {
		// The marks need not wait for the WAL flush: a mark lost in a
		// crash means the rows are published again, the duplicate the
		// relay allows anyway. The next batch does not wait for the disk.
		if _, err := tx.ExecContext(txCtx, "SET LOCAL synchronous_commit = off"); err != nil {
			return 0, fmt.Errorf("begin: %w", err)
		}
	}
	if ctx.Err() != nil {
		return 0, ctx.Err()
	}
	rows, err := r.claim(ctx, tx)
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	if len(rows) == 0 {
		return 0, tx.Commit()
	}
	published, poisoned, perr := r.publish(ctx, rows)
	if r.o.q.claimMarks {
		if rest := rows[published:]; len(rest) > 0 {
			if _, err := tx.ExecContext(txCtx, r.o.q.mark(len(rest), false), offsets(rest)...); err != nil {
				return 0, errors.Join(perr, fmt.Errorf("unmark: %w", err))
			}
		}
	} else if published > 0 {
		if _, err := tx.ExecContext(txCtx, r.o.q.mark(published, true), offsets(rows[:published])...); err != nil {
			return 0, errors.Join(perr, fmt.Errorf("mark: %w", err))
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, errors.Join(perr, fmt.Errorf("commit: %w", err))
	}
	r.forwarded.Add(int64(published - poisoned))
	r.fwdCnt.Add(txCtx, int64(published-poisoned), r.attrs)
	if perr != nil {
		return 0, perr
	}
	return len(rows), nil
}

func offsets(rows []row) []any {
	out := make([]any, len(rows))
	for i, rw := range rows {
		out[i] = rw.offset
	}
	return out
}

func (r *Relay) claim(ctx context.Context, tx wsql.Tx) ([]row, error) {
	rs, err := tx.QueryContext(ctx, r.o.q.claim, r.cfg.BatchSize)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []row
	for rs.Next() {
		var rw row
		var age sql.NullFloat64
		if err := rs.Scan(&rw.offset, &rw.uuid, &rw.topic, &rw.payload, &rw.metadata, &age); err != nil {
			return nil, err
		}
		rw.age = age.Float64
		out = append(out, rw)
	}
	if err := rowsErr(rs); err != nil {
		return nil, err
	}
	// RETURNING has no order: forward in offset order.
	slices.SortFunc(out, func(a, b row) int { return cmp.Compare(a.offset, b.offset) })
	return out, nil
}

// publish publishes rows in order, consecutive rows of one topic in one
// call, and returns how many were published (to their topic or, foreign
// ones, to the poison topic) before the first failure, and how many of
// those were foreign.
func (r *Relay) publish(ctx context.Context, rows []row) (done, poisoned int, err error) {
	for done < len(rows) {
		if ctx.Err() != nil { // closing: the rest stay pending
			return done, poisoned, ctx.Err()
		}
		topic := rows[done].topic
		var msgs []*message.Message
		end := done
		for end < len(rows) && rows[end].topic == topic {
			m, ok := r.message(ctx, rows[end])
			if !ok {
				break
			}
			msgs = append(msgs, m)
			end++
		}
		if len(msgs) > 0 {
			if err := r.out.Publish(topic, msgs...); err != nil {
				r.failed.Add(int64(len(rows) - done))
				r.fail.Add(context.WithoutCancel(ctx), int64(len(rows)-done), r.attrs)
				return done, poisoned, fmt.Errorf("publish %d message(s) to %q: %w", len(msgs), topic, err)
			}
			done = end
			continue
		}
		// rows[done] is foreign: its metadata does not decode.
		if err := r.poison(rows[done]); err != nil {
			return done, poisoned, err
		}
		done++
		poisoned++
	}
	return done, poisoned, nil
}

func (r *Relay) message(ctx context.Context, rw row) (*message.Message, bool) {
	m := message.NewMessage(rw.uuid, rw.payload)
	if err := json.Unmarshal([]byte(rw.metadata), &m.Metadata); err != nil {
		return nil, false
	}
	if m.Metadata == nil {
		m.Metadata = message.Metadata{}
	}
	m.SetContext(ctx)
	return m, true
}

func (r *Relay) poison(rw row) error {
	r.failed.Add(1)
	r.fail.Add(context.Background(), 1, r.attrs)
	r.cfg.Logger.Error("outbox: row's metadata is not a JSON object of strings; publishing it to the poison topic", nil, watermill.LogFields{
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

// listen holds one connection of db in LISTEN on the outbox's channel and
// wakes the relay on each notification, and once after each (re)connect
// for the commits it may have missed.
func (r *Relay) listen(ctx context.Context) {
	for {
		err := r.db.listen(ctx, r.o.q.qTable, r.signal)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNoListen) {
			r.cfg.Logger.Info("outbox: "+err.Error(), nil)
			return
		}
		r.cfg.Logger.Error("outbox: LISTEN connection lost; polling until it is back", err, watermill.LogFields{"retry_in": r.cfg.RetryInterval})
		if !sleep(ctx, r.cfg.RetryInterval) {
			return
		}
	}
}

// Forward forwards every committed row now and returns when the outbox is
// drained: a relay on demand, for tests, tools and cron jobs. It returns the
// number of rows it forwarded.
func (o *Outbox) Forward(ctx context.Context, db *sql.DB, out message.Publisher, cfg RelayConfig) (int64, error) {
	r, err := o.NewRelay(db, out, cfg)
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
