package reliability

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// ChildEnv is the environment variable that turns a re-executed binary into
// one of the campaign's processes; its value is the JSON of a childSpec.
const ChildEnv = "SETTLE_RELIABILITY_CHILD"

// Roles of the campaign's processes.
const (
	roleRelay    = "relay"
	roleConsumer = "consumer"
)

// Phases a child reports in its status file, read by the driver just before
// it kills the process.
const (
	phaseStarting   = "starting"
	phaseIdle       = "idle"
	phaseHandler    = "mid-handler"      // consumer: handler running, nothing committed
	phaseBatch      = "mid-batch"        // batch consumer: keys claimed in a transaction of >= 2 messages, not committed
	phaseEffect     = "effect-unconfirm" // plain consumer: effect written, key not confirmed
	phaseCommitted  = "committed-unacked"
	phasePublishing = "mid-forward" // relay: publishing to the broker
	phasePublished  = "published-unmarked"
	statusWidth     = 64 // a phase, and for mid-batch the open transactions
)

// childSpec is everything a child process needs; the driver passes it in
// ChildEnv.
type childSpec struct {
	Role         string        `json:"role"`
	Name         string        `json:"name"`
	Mode         string        `json:"mode"`
	DB           string        `json:"db"`
	Broker       string        `json:"broker"`
	AMQP         string        `json:"amqp"`
	NATS         string        `json:"nats"`
	Redis        string        `json:"redis"`
	Topic        string        `json:"topic"`
	OutboxTopic  string        `json:"outbox_topic"`
	Claims       string        `json:"claims"`
	Effects      string        `json:"effects"`
	StatusFile   string        `json:"status_file"`
	Seed         uint64        `json:"seed"`
	MaxSleep     time.Duration `json:"max_sleep"`
	ClaimTimeout time.Duration `json:"claim_timeout"`
	MaxAttempts  int           `json:"max_attempts"`
	BatchSize    int           `json:"batch_size"`
	BatchWait    time.Duration `json:"batch_wait"`
	// OneSubscription: one amqpsub subscription with BatchSize deliveries
	// in flight (batch mode).
	OneSubscription bool    `json:"one_subscription"`
	FailRate        float64 `json:"fail_rate"`
}

// IsChild reports whether this process was started by the driver as one of
// the campaign's processes.
func IsChild() bool { return os.Getenv(ChildEnv) != "" }

// RunChild runs the process described by ChildEnv until SIGTERM or SIGINT
// (a graceful stop) or until it is killed. It returns the exit code.
func RunChild() int {
	var spec childSpec
	if err := json.Unmarshal([]byte(os.Getenv(ChildEnv)), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "reliability child: bad", ChildEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var err error
	switch spec.Role {
	case roleRelay:
		err = runRelay(ctx, spec)
	case roleConsumer:
		err = runConsumer(ctx, spec)
	default:
		err = fmt.Errorf("unknown role %q", spec.Role)
	}
	if err != nil && ctx.Err() == nil {
		fmt.Fprintf(os.Stderr, "reliability %s: %v\n", spec.Name, err)
		return 1
	}
	return 0
}

// status writes the process's phase at the start of its status file.
type status struct {
	mu sync.Mutex
	f  *os.File
}

func openStatus(path string) (*status, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	s := &status{f: f}
	s.set(phaseStarting)
	return s, nil
}

func (s *status) set(phase string) {
	var b [statusWidth]byte
	for i := range b {
		b[i] = ' '
	}
	copy(b[:], phase)
	s.mu.Lock()
	_, _ = s.f.WriteAt(b[:], 0)
	s.mu.Unlock()
}

func (s *status) close() { _ = s.f.Close() }

// sleeper sleeps a random time up to max, honouring ctx.
type sleeper struct {
	mu  sync.Mutex
	rnd *rand.Rand
	max time.Duration
}

func (s *sleeper) sleep(ctx context.Context) {
	if s.max <= 0 {
		return
	}
	s.mu.Lock()
	d := time.Duration(s.rnd.Int64N(int64(s.max)))
	s.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// child is what both roles open: the database, the status file, the
// sleeper, the logger, the broker's publisher and, for a consumer, its
// subscriber.
type child struct {
	db      *sql.DB
	dialect sqldb.Dialect
	st      *status
	sl      *sleeper
	logger  watermill.LoggerAdapter
	pub     message.Publisher
	sub     message.Subscriber
}

func openChild(spec childSpec, withSub bool) (*child, error) {
	db, dialect, err := sqlurl.Open(spec.DB)
	if err != nil {
		return nil, err
	}
	st, err := openStatus(spec.StatusFile)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	c := &child{
		db:      db,
		dialect: dialect,
		st:      st,
		sl:      &sleeper{rnd: rand.New(rand.NewPCG(spec.Seed, uint64(os.Getpid()))), max: spec.MaxSleep},
		logger:  watermill.NewStdLoggerWithOut(os.Stderr, false, false),
	}
	if c.pub, c.sub, err = pubSub(spec, c.logger, withSub); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

// close closes the subscriber and the publisher (if open), the status file
// and the database.
func (c *child) close() {
	if c.sub != nil {
		_ = c.sub.Close()
	}
	if c.pub != nil {
		_ = c.pub.Close()
	}
	c.st.close()
	_ = c.db.Close()
}

// runRelay forwards the outbox to the broker. Its publisher reports the phases
// around each publish and sleeps after the broker's confirmation, widening
// the window in which a kill leaves a published row unmarked.
func runRelay(ctx context.Context, spec childSpec) error {
	c, err := openChild(spec, false)
	if err != nil {
		return err
	}
	defer c.close()
	db, dialect, st, sl, logger, pub := c.db, c.dialect, c.st, c.sl, c.logger, c.pub
	ob, err := outbox.New(sqldb.Std(db, sqldb.Dialect(dialect)), outbox.Config{Topic: spec.OutboxTopic, Logger: logger})
	if err != nil {
		return err
	}
	relay, err := ob.NewRelay(&phasePublisher{Publisher: pub, st: st, sl: sl, ctx: ctx},
		outbox.RelayConfig{PollInterval: 10 * time.Millisecond, AckDeadline: 5 * time.Second, CloseTimeout: 5 * time.Second, Logger: logger})
	if err != nil {
		return err
	}
	st.set(phaseIdle)
	err = relay.Run(ctx)
	return errors.Join(err, relay.Close())
}

type phasePublisher struct {
	message.Publisher
	st  *status
	sl  *sleeper
	ctx context.Context
}

func (p *phasePublisher) Publish(topic string, msgs ...*message.Message) error {
	p.st.set(phasePublishing)
	err := p.Publisher.Publish(topic, msgs...)
	if err == nil {
		p.st.set(phasePublished)
		p.sl.sleep(p.ctx)
	}
	p.st.set(phaseIdle)
	return err
}

// Close does not close the real publisher: runRelay does.
func (p *phasePublisher) Close() error { return nil }

// runConsumer consumes the campaign's topic with settle's stack and writes
// one effect row per delivery that reaches the handler's success path.
func runConsumer(ctx context.Context, spec childSpec) error {
	c, err := openChild(spec, true)
	if err != nil {
		return err
	}
	defer c.close()
	db, dialect, st, sl, logger, pub, sub := c.db, c.dialect, c.st, c.sl, c.logger, c.pub, c.sub
	store, err := dedupe.NewSQLStore(sqldb.Std(db, dialect), dedupe.SQLConfig{Table: spec.Claims})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	// In batch mode the phase is derived from all deliveries in flight
	// (see batchStatus); in the other modes the last one to move sets it.
	var bs *batchStatus
	if spec.Mode == ModeBatch {
		bs = newBatchStatus(st)
	}
	// Outermost: the phase between the handler's success (committed or
	// confirmed) and the ack, with a random sleep to widen it.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if bs != nil {
				bs.leave(msg, err == nil)
				if err == nil {
					sl.sleep(ctx)
					bs.acked()
				}
				return out, err
			}
			if err == nil {
				st.set(phaseCommitted)
				sl.sleep(ctx)
			}
			st.set(phaseIdle)
			return out, err
		}
	})
	concurrency := 1
	if spec.Mode == ModeBatch && !spec.OneSubscription {
		// As many subscriptions as a batch holds, so that batches can fill
		// (one amqpsub subscription has them all in flight; a
		// watermill-nats or watermill-redisstream subscription hands out one
		// delivery at a time, as watermill-amqp's does).
		concurrency = spec.BatchSize
	}
	p, err := pipeline.New(router, pipeline.Config{
		Publisher:      pub,
		Store:          store,
		ClaimTimeout:   spec.ClaimTimeout,
		DisableTracing: true,
		Logger:         logger,
		BusyDelay:      50 * time.Millisecond,
		Concurrency:    concurrency,
		Retry: middleware.RetryConfig{
			MaxAttempts:      spec.MaxAttempts,
			InProcessRetries: 1,
			InitialInterval:  20 * time.Millisecond,
			MaxInterval:      200 * time.Millisecond,
			RedeliveryDelay:  50 * time.Millisecond,
		},
	})
	if err != nil {
		return err
	}
	// tx identifies the transaction of an effect row in batch mode (0 in
	// the other modes), so that the driver can tell which batches committed.
	insert := "INSERT INTO " + spec.Effects + " (msg_id, pid, tx) VALUES (?, ?, ?)"
	if dialect == sqldb.Postgres {
		insert = "INSERT INTO " + spec.Effects + " (msg_id, pid, tx) VALUES ($1, $2, $3)"
	}
	count := "SELECT COUNT(*) FROM " + spec.Effects + " WHERE msg_id = ?"
	if dialect == sqldb.Postgres {
		count = "SELECT COUNT(*) FROM " + spec.Effects + " WHERE msg_id = $1"
	}
	pid := os.Getpid()
	fail := &failer{rnd: rand.New(rand.NewPCG(spec.Seed^0x5bd1e995, uint64(pid))), rate: spec.FailRate}
	switch spec.Mode {
	case ModeTx:
		_, err = pipeline.HandleTx(p, "effect", spec.Topic, sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(db, dialect)},
			func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
				st.set(phaseHandler)
				// A read first, as handlers do before they write: at
				// REPEATABLE READ (MariaDB's default) it fixes the
				// transaction's snapshot, with this consumer's claim in it.
				if err := tx.QueryRowContext(ctx, count, msg.UUID).Scan(new(int)); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, insert, msg.UUID, pid, 0); err != nil {
					return err
				}
				// The effect is written, not committed. The message's id
				// follows the phase, for a SIGSTOP aimed at a consumer in
				// its handler (FaultSIGSTOP): woken, the handler returns
				// and the pipeline confirms and commits.
				st.set(phaseHandler + " " + msg.UUID)
				sl.sleep(ctx)
				// Without the id from here on: a consumer stopped after
				// this line may be in its confirmation, holding the claim's
				// row lock, which no zombie has.
				st.set(phaseHandler)
				if fail.now() { // after the effect: the rollback must undo it
					return errInjected
				}
				return ctx.Err()
			})
	case ModeBatch:
		_, err = pipeline.HandleTx(p, "effect", spec.Topic, sub, pipeline.TxConfig[*sql.Tx]{
			DB:    sqldb.Std(db, dialect),
			Batch: pipeline.BatchConfig{MaxSize: spec.BatchSize, MaxWait: spec.BatchWait},
		}, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			// Called after the batch's claim statement, before its commit.
			seq := bs.enter(tx, msg)
			sl.sleep(ctx)
			_, err := tx.ExecContext(ctx, insert, msg.UUID, pid, seq)
			if err == nil && fail.now() {
				// After the effect: the batch is rolled back and run again
				// without this message; its effect must go with the rollback.
				err = errInjected
			}
			if err == nil {
				err = ctx.Err()
			}
			if err != nil {
				bs.failed(seq)
			}
			return err
		})
	case ModePlain:
		_, err = p.Handle("effect", spec.Topic, sub, func(msg *message.Message) error {
			ctx := msg.Context()
			st.set(phaseHandler)
			sl.sleep(ctx)
			if fail.now() { // before the effect: plain mode has no rollback
				return errInjected
			}
			if _, err := db.ExecContext(ctx, insert, msg.UUID, pid, 0); err != nil {
				return err
			}
			// The documented window: the effect is written, the key is
			// confirmed only when this returns.
			st.set(phaseEffect)
			sl.sleep(ctx)
			return nil
		})
	default:
		err = fmt.Errorf("unknown mode %q", spec.Mode)
	}
	if err != nil {
		return err
	}
	go func() {
		select {
		case <-router.Running():
			st.set(phaseIdle)
		case <-ctx.Done():
		}
	}()
	return router.Run(ctx)
}

// errInjected is the failure a consumer injects on purpose (Config.FailRate).
var errInjected = errors.New("reliability: injected handler failure")

// failer decides which handler calls fail on purpose.
type failer struct {
	mu   sync.Mutex
	rnd  *rand.Rand
	rate float64
}

func (f *failer) now() bool {
	if f.rate <= 0 {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rnd.Float64() < f.rate
}

// batchStatus derives a batch consumer's phase from every delivery in
// flight, since a batch is many deliveries at once: mid-batch (followed by
// the numbers of the open transactions) while a transaction holds at least
// two deliveries whose handler ran in it, so the batch's claim statement has
// run and its commit has not returned; mid-handler while a transaction holds
// one; committed-unacked while a delivery has succeeded and waits for its
// ack; idle otherwise.
type batchStatus struct {
	st *status

	mu      sync.Mutex
	next    int                      // number of the next transaction
	txs     map[*sql.Tx]int          // number of each transaction seen
	in      map[*message.Message]int // delivery -> transaction its handler last ran in
	unacked int
}

func newBatchStatus(st *status) *batchStatus {
	return &batchStatus{st: st, txs: map[*sql.Tx]int{}, in: map[*message.Message]int{}}
}

// enter records a handler call of msg in tx and returns tx's number.
func (b *batchStatus) enter(tx *sql.Tx, msg *message.Message) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	seq, ok := b.txs[tx]
	if !ok {
		b.next++
		seq = b.next
		b.txs[tx] = seq
	}
	old, had := b.in[msg]
	b.in[msg] = seq
	if had && old != seq {
		b.forget(old)
	}
	b.write()
	return seq
}

// failed records that transaction seq is being rolled back: its deliveries
// are out of it until the batch runs again.
func (b *batchStatus) failed(seq int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for m, s := range b.in {
		if s == seq {
			delete(b.in, m)
		}
	}
	b.forget(seq)
	b.write()
}

// leave records that msg's handler returned, successfully or not.
func (b *batchStatus) leave(msg *message.Message, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if seq, had := b.in[msg]; had {
		delete(b.in, msg)
		b.forget(seq)
	}
	if ok {
		b.unacked++
	}
	b.write()
}

// acked records that a successful delivery is about to be acked.
func (b *batchStatus) acked() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.unacked--
	b.write()
}

// forget drops transaction seq once no delivery is in it.
func (b *batchStatus) forget(seq int) {
	for _, s := range b.in {
		if s == seq {
			return
		}
	}
	for tx, s := range b.txs {
		if s == seq {
			delete(b.txs, tx)
		}
	}
}

func (b *batchStatus) write() {
	per := map[int]int{}
	for _, s := range b.in {
		per[s]++
	}
	var open []int
	for s, n := range per {
		if n >= 2 {
			open = append(open, s)
		}
	}
	switch {
	case len(open) > 0:
		slices.Sort(open)
		line := phaseBatch
		for _, s := range open {
			line += " " + strconv.Itoa(s)
		}
		b.st.set(line)
	case len(b.in) > 0:
		b.st.set(phaseHandler)
	case b.unacked > 0:
		b.st.set(phaseCommitted)
	default:
		b.st.set(phaseIdle)
	}
}
