// Package reliability is settle's crash, restart and service-fault campaign:
// a driver that runs a relay and two consumers as separate processes on a
// broker (RabbitMQ, NATS JetStream or Redis Streams, see Config.Broker) and
// a SQL database, kills them with SIGKILL (or stops them with SIGTERM) at
// random points, stops and restarts the services, freezes a consumer with
// SIGSTOP past its claim (a zombie), and then counts the effects of every
// logical message. bench/reliability is its command; the integration tests
// run a short version.
package reliability

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// Modes of the consumers.
const (
	// ModeTx: pipeline.HandleTx, the effect row and the dedupe confirmation
	// commit in one transaction.
	ModeTx = "tx"
	// ModePlain: the dedupe middleware with a SQLStore and a handler that
	// writes the effect on the plain *sql.DB, outside any transaction.
	ModePlain = "plain"
	// ModeBatch: pipeline.HandleTx with group commit (TxConfig.Batch): the
	// deliveries in flight in a consumer share one transaction, their keys
	// claimed as confirmed in one statement, and are acked after its commit.
	ModeBatch = "batch"
)

// Brokers the campaign runs on.
const (
	// BrokerAMQP: RabbitMQ through watermill-amqp (or amqpsub, see
	// Config.OneSubscription).
	BrokerAMQP = "amqp"
	// BrokerNATS: NATS JetStream through watermill-nats, a durable consumer
	// delivered to a queue group, manual acks.
	BrokerNATS = "nats"
	// BrokerRedis: Redis Streams through watermill-redisstream, a consumer
	// group whose consumers claim what a dead one left pending.
	BrokerRedis = "redis"
)

// Faults the campaign can inject after its kill cycles.
const (
	// FaultRabbitMQ stops the RabbitMQ application (rabbitmqctl stop_app)
	// for Config.FaultHold and starts it again (BrokerAMQP).
	FaultRabbitMQ = "rabbitmq"
	// FaultNATS stops nats-server (start-stop-daemon --stop) for
	// Config.FaultHold and starts it again with the machine's command
	// (BrokerNATS). JetStream keeps its streams and consumers on disk.
	FaultNATS = "nats"
	// FaultPostgres restarts the PostgreSQL cluster (pg_ctlcluster restart).
	FaultPostgres = "postgres"
	// FaultPGTerminate kills every other connection to the database with
	// pg_terminate_backend.
	FaultPGTerminate = "pgterminate"
	// FaultSIGSTOP (tx mode) makes a zombie of a consumer: it is stopped
	// with SIGSTOP in its handler (after its transaction's first read, so that
	// at REPEATABLE READ the transaction holds a snapshot in which the
	// consumer owns its claim, and after its effect row, before its commit),
	// for longer than the claim timeout; a second delivery of its message is
	// published (as the relay may publish one), which the other consumer
	// takes, taking the expired claim over and committing the effect; then
	// the zombie is woken with SIGCONT and goes on where it stopped, towards
	// its own confirmation and commit, which must fail. Repeat it in Faults
	// for more zombies.
	FaultSIGSTOP = "sigstop"
)

// Config configures a campaign.
type Config struct {
	// DB is the database URL (postgres:// or mysql://). Required.
	DB string
	// Broker is BrokerAMQP, BrokerNATS or BrokerRedis. Defaults to
	// BrokerAMQP.
	Broker string
	// AMQP is the RabbitMQ URL. Required with BrokerAMQP.
	AMQP string
	// NATS is the NATS URL (with JetStream enabled). Required with
	// BrokerNATS.
	NATS string
	// Redis is the Redis URL (redis://host:port/db). Required with
	// BrokerRedis. The campaign's streams are deleted at the end.
	Redis string
	// Mode is ModeTx, ModePlain or ModeBatch. Defaults to ModeTx.
	Mode string
	// Cycles is the number of kill-and-restart cycles. Must be >= 0.
	Cycles int
	// Messages is the number of logical messages placed in the outbox
	// during the kill cycles. Defaults to 5 per cycle, at least 100.
	Messages int
	// Faults are injected one after another after the kill cycles while
	// messages keep flowing: FaultRabbitMQ, FaultPostgres, FaultPGTerminate,
	// FaultSIGSTOP; a fault may be named more than once.
	Faults []string
	// Seed makes the kill schedule repeatable. Defaults to the clock.
	Seed uint64
	// MinDelay and MaxDelay bound the random wait before each kill. Default
	// 2ms and 100ms.
	MinDelay, MaxDelay time.Duration
	// MaxSleep bounds the random sleeps of the processes in the handler,
	// between commit and ack, and between a forward and its mark. Defaults
	// to 10ms. Must be >= 0.
	MaxSleep time.Duration
	// ClaimTimeout is the consumers' dedupe claim timeout: how soon the
	// message of a killed consumer is taken over. Defaults to 2s.
	ClaimTimeout time.Duration
	// BatchSize is, in ModeBatch, each consumer's pipeline Concurrency and
	// its TxConfig.Batch.MaxSize: the most deliveries one transaction
	// carries. Defaults to 8. Must be >= 2.
	BatchSize int
	// OneSubscription makes, in ModeBatch on BrokerAMQP or BrokerRedis, each
	// consumer take its deliveries through one subscription with BatchSize
	// of them in flight (amqpsub's, redissub's), instead of BatchSize
	// subscriptions of one delivery each.
	OneSubscription bool
	// BatchWait is, in ModeBatch, TxConfig.Batch.MaxWait: how long the first
	// delivery of a batch waits for others. Defaults to 50ms (the relay
	// forwards one message at a time, so deliveries trickle in); a negative
	// value means no wait.
	BatchWait time.Duration
	// Aim is, in ModeBatch, the share of consumer kills that wait (up to
	// one more second) for the consumer to report a batch between its claim
	// statement and its commit before the signal. 0 means none: every kill
	// lands at a random moment. Must be in [0, 1].
	Aim float64
	// StopRate is the share of the kill cycles whose process is stopped
	// gracefully with SIGTERM instead of killed with SIGKILL: it closes its
	// router and subscriber with deliveries in flight, as in a rolling
	// restart (a subscriber that acks what it gives up on loses them). The
	// process gets 20s to exit, then SIGKILL. 0 means none. Must be in
	// [0, 1].
	StopRate float64
	// FailRate is the share of handler calls that fail on purpose with a
	// transient error: in tx and batch mode after the effect row is written
	// (the rollback must take it away; in batch mode the rest of the batch
	// runs again without the message), in plain mode before it. 0 means
	// none. Must be in [0, 0.5].
	FailRate float64
	// FaultHold is how long RabbitMQ or NATS stays stopped. Defaults to 3s.
	FaultHold time.Duration
	// RecoverTimeout bounds the wait for the first effect after a fault.
	// Defaults to 60s.
	RecoverTimeout time.Duration
	// DrainTimeout bounds the final drain. Defaults to 120s.
	DrainTimeout time.Duration
	// Command returns the command that re-executes this program as a
	// campaign process; the driver adds ChildEnv to its environment and the
	// program must then call RunChild. Required.
	Command func() *exec.Cmd
	// Out receives progress lines. Defaults to io.Discard.
	Out io.Writer
	// Keep leaves the tables, queues and process logs in place.
	Keep bool
}

func (c *Config) setDefaults() {
	if c.Mode == "" {
		c.Mode = ModeTx
	}
	if c.Broker == "" {
		c.Broker = BrokerAMQP
	}
	if c.Messages == 0 {
		c.Messages = max(100, 5*c.Cycles)
	}
	if c.Seed == 0 {
		c.Seed = uint64(time.Now().UnixNano())
	}
	if c.MinDelay == 0 {
		c.MinDelay = 2 * time.Millisecond
	}
	if c.MaxDelay == 0 {
		c.MaxDelay = 100 * time.Millisecond
	}
	if c.MaxSleep == 0 {
		c.MaxSleep = 10 * time.Millisecond
	}
	if c.ClaimTimeout == 0 {
		c.ClaimTimeout = 2 * time.Second
	}
	if c.BatchSize == 0 {
		c.BatchSize = 8
	}
	if c.BatchWait == 0 {
		c.BatchWait = 50 * time.Millisecond
	}
	if c.FaultHold == 0 {
		c.FaultHold = 3 * time.Second
	}
	if c.RecoverTimeout == 0 {
		c.RecoverTimeout = 60 * time.Second
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 120 * time.Second
	}
	if c.Out == nil {
		c.Out = io.Discard
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.DB == "":
		return errors.New("reliability: Config.DB is required")
	case c.Broker != BrokerAMQP && c.Broker != BrokerNATS && c.Broker != BrokerRedis:
		return fmt.Errorf("reliability: Config.Broker must be %q, %q or %q, got %q", BrokerAMQP, BrokerNATS, BrokerRedis, c.Broker)
	case c.Broker == BrokerAMQP && c.AMQP == "":
		return errors.New("reliability: Config.AMQP is required with broker " + BrokerAMQP)
	case c.Broker == BrokerNATS && c.NATS == "":
		return errors.New("reliability: Config.NATS is required with broker " + BrokerNATS)
	case c.Broker == BrokerRedis && c.Redis == "":
		return errors.New("reliability: Config.Redis is required with broker " + BrokerRedis)
	case c.Mode != ModeTx && c.Mode != ModePlain && c.Mode != ModeBatch:
		return fmt.Errorf("reliability: Config.Mode must be %q, %q or %q, got %q", ModeTx, ModePlain, ModeBatch, c.Mode)
	case c.Cycles < 0:
		return fmt.Errorf("reliability: Config.Cycles must be >= 0, got %d", c.Cycles)
	case c.Messages < 1:
		return fmt.Errorf("reliability: Config.Messages must be >= 1, got %d", c.Messages)
	case c.MinDelay < 0 || c.MaxDelay <= c.MinDelay:
		return fmt.Errorf("reliability: Config.MinDelay (%v) must be >= 0 and < MaxDelay (%v)", c.MinDelay, c.MaxDelay)
	case c.MaxSleep < 0:
		return fmt.Errorf("reliability: Config.MaxSleep must be >= 0, got %v", c.MaxSleep)
	case c.BatchSize < 2:
		return fmt.Errorf("reliability: Config.BatchSize must be >= 2, got %d", c.BatchSize)
	case c.OneSubscription && (c.Mode != ModeBatch || c.Broker == BrokerNATS):
		return fmt.Errorf("reliability: Config.OneSubscription is for mode %q on broker %q or %q, got %q on %q", ModeBatch, BrokerAMQP, BrokerRedis, c.Mode, c.Broker)
	case c.Aim < 0 || c.Aim > 1:
		return fmt.Errorf("reliability: Config.Aim must be in [0, 1], got %v", c.Aim)
	case c.StopRate < 0 || c.StopRate > 1:
		return fmt.Errorf("reliability: Config.StopRate must be in [0, 1], got %v", c.StopRate)
	case c.FailRate < 0 || c.FailRate > 0.5:
		return fmt.Errorf("reliability: Config.FailRate must be in [0, 0.5], got %v", c.FailRate)
	case c.Command == nil:
		return errors.New("reliability: Config.Command is required")
	}
	for _, f := range c.Faults {
		switch f {
		case FaultPostgres, FaultPGTerminate:
		case FaultRabbitMQ, FaultNATS:
			if want := map[string]string{FaultRabbitMQ: BrokerAMQP, FaultNATS: BrokerNATS}[f]; c.Broker != want {
				return fmt.Errorf("reliability: Config.Faults: fault %s is for broker %q, not %q", f, want, c.Broker)
			}
		case FaultSIGSTOP:
			if c.Mode != ModeTx {
				return fmt.Errorf("reliability: Config.Faults: fault %s is for mode %q, not %q", f, ModeTx, c.Mode)
			}
		default:
			return fmt.Errorf("reliability: Config.Faults: unknown fault %q (want %s, %s, %s, %s or %s)", f, FaultRabbitMQ, FaultNATS, FaultPostgres, FaultPGTerminate, FaultSIGSTOP)
		}
	}
	return nil
}

// FaultResult is what one injected fault did.
type FaultResult struct {
	Fault string
	// Outage is how long the injection itself took (the service was down or
	// restarting during it).
	Outage time.Duration
	// Recovery runs from the end of the injection to the next effect row.
	Recovery time.Duration
	// CaughtUp runs from the end of the injection until every message placed
	// before it had its effect.
	CaughtUp time.Duration
	// Recovered is false when no effect came within Config.RecoverTimeout.
	Recovered bool
}

// Result is the campaign's outcome.
type Result struct {
	Mode, Dialect, Broker string
	Seed                  uint64
	Cycles                int
	// Kills counts the kills by process role and by the phase the process
	// reported just before it was killed (graceful stops included).
	Kills map[string]map[string]int
	// GracefulStops counts the kills that were a SIGTERM (Config.StopRate).
	GracefulStops int
	// UnexpectedExits counts processes that ended without being killed:
	// they gave up on an error instead of recovering.
	UnexpectedExits int
	Faults          []FaultResult

	Placed       int // logical messages committed to the outbox
	Effects      int // effect rows
	Lost         int // placed messages without an effect
	Duplicated   int // placed messages with more than one effect
	Extra        int // effect rows beyond the first per message
	Unplaced     int // effect rows of no placed message (must be 0)
	DeadLettered int // copies on the dead-letter and poison queues
	LeftOnQueue  int // deliveries still on the queue (not acked) after the consumers stopped
	ClaimRuns    int // claims acquired (handler starts), summed over messages

	// Batch mode only.
	Transactions int // committed transactions that wrote effects
	LargestBatch int // most effects one transaction committed
	// BatchSizes counts the committed transactions by their effects.
	BatchSizes map[int]int
	// Aimed counts the consumer kills that waited for a batch (Config.Aim).
	Aimed int
	// BatchKills counts the kills whose process reported, just before the
	// signal, a transaction of two or more messages between its claim
	// statement and its commit.
	BatchKills int
	// BatchKillsUncommitted counts those of BatchKills whose reported
	// transactions left no effect row: the kill really landed before the
	// commit (the others raced it, and the commit won).
	BatchKillsUncommitted int

	// FaultSIGSTOP only.
	// Zombies counts the consumers stopped in their handler, past their
	// claim, and woken once another consumer had committed the effect of the
	// message they were handling.
	Zombies int
	// ZombieMisses counts the SIGSTOP faults that caught no consumer in its
	// handler, or whose message no other consumer took over in time.
	ZombieMisses int
	// ZombieCommits counts the zombies whose own transaction committed an
	// effect of that message after they woke (each is a doubled message).
	ZombieCommits int

	Duration  time.Duration
	DrainTime time.Duration
	// Unfinished says why the drain ended before everything settled
	// (Config.DrainTimeout); the counts are then of an unfinished run.
	Unfinished string
}

// Err reports why the campaign failed, or nil: a drain that did not finish,
// anything lost, dead-lettered, left on the queue or unrecovered, a process
// that gave up, in tx and batch mode any message with more than one effect,
// and in batch mode a campaign that aimed kills at batches without one
// landing before a commit.
func (r Result) Err() error {
	var errs []error
	if r.Unfinished != "" {
		errs = append(errs, errors.New(r.Unfinished))
	}
	if r.Lost > 0 {
		errs = append(errs, fmt.Errorf("%d messages lost", r.Lost))
	}
	if r.Mode != ModePlain && r.Duplicated > 0 {
		errs = append(errs, fmt.Errorf("%d messages have more than one effect in %s mode", r.Duplicated, r.Mode))
	}
	if r.Mode == ModeBatch && r.Aimed > 0 && r.BatchKillsUncommitted == 0 {
		errs = append(errs, fmt.Errorf("%d kills aimed at batches, none landed between a claim statement and its commit", r.Aimed))
	}
	if r.Unplaced > 0 {
		errs = append(errs, fmt.Errorf("%d effects of messages never placed", r.Unplaced))
	}
	if r.DeadLettered > 0 {
		errs = append(errs, fmt.Errorf("%d messages dead-lettered or poisoned", r.DeadLettered))
	}
	if r.LeftOnQueue > 0 {
		errs = append(errs, fmt.Errorf("%d deliveries left on the queue", r.LeftOnQueue))
	}
	if r.UnexpectedExits > 0 {
		errs = append(errs, fmt.Errorf("%d processes exited without being killed", r.UnexpectedExits))
	}
	stops := 0
	for _, f := range r.Faults {
		if !f.Recovered {
			errs = append(errs, fmt.Errorf("no effect after fault %s", f.Fault))
		}
		if f.Fault == FaultSIGSTOP {
			stops++
		}
	}
	if stops > 0 && r.Zombies == 0 {
		errs = append(errs, fmt.Errorf("%d SIGSTOP faults, none made a zombie (stopped in its handler, its message taken over)", stops))
	}
	if r.Mode != ModePlain && r.ZombieCommits > 0 {
		errs = append(errs, fmt.Errorf("%d zombie consumers committed an effect after another consumer took their message over", r.ZombieCommits))
	}
	return errors.Join(errs...)
}

// Run runs a campaign and returns its result. The error is about the
// campaign itself (setup, a service that did not come back); the verdict on
// settle is Result.Err.
func Run(ctx context.Context, cfg Config) (Result, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Result{}, err
	}
	d, err := newDriver(ctx, cfg)
	if err != nil {
		return Result{}, err
	}
	res, err := d.run(ctx)
	cerr := d.close(err != nil || res.Err() != nil)
	return res, errors.Join(err, cerr)
}

type driver struct {
	cfg     Config
	db      *sql.DB
	dialect sqldb.Dialect
	broker  brokerAdmin
	ob      *outbox.Outbox[*sql.Tx]
	rnd     *mrand.Rand
	runID   string
	dir     string
	procs   []*proc

	topic, outboxTopic, claims, effects, placed string

	appName string // PostgreSQL application_name of every connection of the run
	// batchKills are the kills that landed in a batch: the process and the
	// open transactions it reported.
	batchKills []batchKill
	// zombies are the consumers FaultSIGSTOP stopped and woke.
	zombies []zombie
	next    int // sequence of the next logical message
	res     Result
}

func newDriver(ctx context.Context, cfg Config) (d *driver, err error) {
	var b [4]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	d = &driver{
		cfg: cfg, runID: id,
		rnd:         mrand.New(mrand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		topic:       "rel_" + id,
		outboxTopic: "rel_outbox_" + id,
		claims:      "rel_claims_" + id,
		effects:     "rel_effects_" + id,
		placed:      "rel_placed_" + id,
		res:         Result{Mode: cfg.Mode, Broker: cfg.Broker, Seed: cfg.Seed, Cycles: cfg.Cycles, Kills: map[string]map[string]int{}},
	}
	d.broker = newBrokerAdmin(cfg, d.topic)
	if d.dialect, err = dialectOf(cfg.DB); err != nil {
		return nil, err
	}
	if d.dialect == sqldb.Postgres {
		// Every connection of the run carries the run's name, so that the
		// pgterminate fault kills the campaign's connections and nobody
		// else's.
		d.appName = "settle_rel_" + id
		sep := "?"
		if strings.Contains(d.cfg.DB, "?") {
			sep = "&"
		}
		d.cfg.DB += sep + "application_name=" + d.appName
	}
	if d.db, _, err = sqlurl.Open(d.cfg.DB); err != nil {
		return nil, err
	}
	d.res.Dialect = string(d.dialect)
	defer func() {
		if err != nil {
			_ = d.close(false)
		}
	}()
	if d.dialect != sqldb.Postgres && d.dialect != sqldb.MySQL {
		return nil, fmt.Errorf("reliability: the campaign needs PostgreSQL or MySQL/MariaDB, got %s", d.dialect)
	}
	for _, f := range cfg.Faults {
		if (f == FaultPostgres || f == FaultPGTerminate) && d.dialect != sqldb.Postgres {
			return nil, fmt.Errorf("reliability: fault %s needs PostgreSQL", f)
		}
	}
	if err := d.db.PingContext(ctx); err != nil {
		return nil, fmt.Errorf("reliability: database: %w", err)
	}
	if d.dir, err = os.MkdirTemp("", "settle-reliability-"); err != nil {
		return nil, err
	}
	claims, err := dedupe.NewSQLStore(sqldb.Std(d.db, d.dialect), dedupe.SQLConfig{Table: d.claims})
	if err != nil {
		return nil, err
	}
	ddl := claims.Schema()
	ddl = append(ddl,
		// No unique key: a second effect is counted, not refused.
		// tx numbers the transactions of a batch consumer (0 otherwise).
		"CREATE TABLE "+d.effects+" (msg_id VARCHAR(64) NOT NULL, pid INTEGER NOT NULL, tx INTEGER NOT NULL)",
		"CREATE TABLE "+d.placed+" (seq INTEGER NOT NULL PRIMARY KEY, msg_id VARCHAR(64) NOT NULL)",
	)
	for _, q := range ddl {
		if _, err := d.db.ExecContext(ctx, q); err != nil {
			return nil, fmt.Errorf("reliability: schema: %w", err)
		}
	}
	if d.ob, err = outbox.New(sqldb.Std(d.db, sqldb.Dialect(d.dialect)), outbox.Config{Topic: d.outboxTopic}); err != nil {
		return nil, err
	}
	if err := d.ob.InitSchema(ctx); err != nil {
		return nil, err
	}
	if err := d.broker.declare(ctx); err != nil {
		return nil, err
	}
	return d, nil
}

func dialectOf(u string) (sqldb.Dialect, error) {
	_, _, dialect, err := sqlurl.Parse(u)
	return dialect, err
}

func (d *driver) say(format string, args ...any) {
	fmt.Fprintf(d.cfg.Out, time.Now().Format("15:04:05.000")+" "+format+"\n", args...)
}

func (d *driver) run(ctx context.Context) (Result, error) {
	start := time.Now()
	d.say("run %s: %s mode on %s and %s, %d cycles, %d messages, faults %v, seed %d, logs in %s",
		d.runID, d.cfg.Mode, d.dialect, d.cfg.Broker, d.cfg.Cycles, d.cfg.Messages, d.cfg.Faults, d.cfg.Seed, d.dir)
	for i, spec := range []childSpec{{Role: roleRelay, Name: "relay"}, {Role: roleConsumer, Name: "consumer-1"}, {Role: roleConsumer, Name: "consumer-2"}} {
		spec.Mode, spec.DB = d.cfg.Mode, d.cfg.DB // DB with the run's application_name
		spec.Broker, spec.AMQP, spec.NATS, spec.Redis = d.cfg.Broker, d.cfg.AMQP, d.cfg.NATS, d.cfg.Redis
		spec.Topic, spec.OutboxTopic, spec.Claims, spec.Effects = d.topic, d.outboxTopic, d.claims, d.effects
		spec.StatusFile = filepath.Join(d.dir, spec.Name+".status")
		spec.MaxSleep, spec.ClaimTimeout = d.cfg.MaxSleep, d.cfg.ClaimTimeout
		spec.BatchSize, spec.BatchWait, spec.FailRate = d.cfg.BatchSize, d.cfg.BatchWait, d.cfg.FailRate
		spec.OneSubscription = d.cfg.OneSubscription
		// Attempts are counted per claim, and every kill of a consumer in
		// its handler costs one: keep dead-lettering out of the picture.
		spec.MaxAttempts = 1000
		p := &proc{spec: spec, seed: d.cfg.Seed + uint64(i)*1_000_003}
		log, err := os.Create(filepath.Join(d.dir, spec.Name+".log"))
		if err != nil {
			return d.res, err
		}
		p.log = log
		d.procs = append(d.procs, p)
		if err := d.start(p); err != nil {
			return d.res, err
		}
	}

	if err := d.killCycles(ctx); err != nil {
		return d.res, err
	}
	if len(d.cfg.Faults) > 0 {
		if err := d.faults(ctx); err != nil {
			return d.res, err
		}
	}
	drainStart := time.Now()
	if err := d.drain(ctx); err != nil {
		if !errors.Is(err, errUnfinished) || ctx.Err() != nil {
			return d.res, err
		}
		// Counted all the same: what is missing is the verdict.
		d.res.Unfinished = err.Error()
		d.say("%v", err)
	}
	d.res.DrainTime = time.Since(drainStart)
	d.stopAll()
	if err := d.count(ctx); err != nil {
		return d.res, err
	}
	d.res.Duration = time.Since(start)
	return d.res, nil
}

// killCycles places the messages in batches and kills a random process
// after each batch, restarting it at once.
func (d *driver) killCycles(ctx context.Context) error {
	per := d.cfg.Messages
	if d.cfg.Cycles > 0 {
		per = (d.cfg.Messages + d.cfg.Cycles - 1) / d.cfg.Cycles
	}
	for c := 0; c < d.cfg.Cycles; c++ {
		if n := min(per, d.cfg.Messages-d.next); n > 0 {
			if err := d.place(ctx, n); err != nil {
				return err
			}
		}
		delay := d.cfg.MinDelay + time.Duration(d.rnd.Int64N(int64(d.cfg.MaxDelay-d.cfg.MinDelay)))
		if err := sleepCtx(ctx, delay); err != nil {
			return err
		}
		if err := d.checkExits(); err != nil {
			return err
		}
		p := d.procs[d.rnd.IntN(len(d.procs))]
		var line string
		if d.cfg.Mode == ModeBatch && p.spec.Role == roleConsumer && d.cfg.Aim > 0 && d.rnd.Float64() < d.cfg.Aim {
			d.res.Aimed++
			line = d.awaitBatch(ctx, p)
		} else {
			line = p.status()
		}
		pid := p.cmd.Process.Pid
		sig := syscall.SIGKILL
		if d.cfg.StopRate > 0 && d.rnd.Float64() < d.cfg.StopRate {
			sig = syscall.SIGTERM
			d.res.GracefulStops++
		}
		if err := d.kill(p, sig); err != nil {
			return err
		}
		phase, txs := parseStatus(line)
		if phase == phaseBatch {
			d.batchKills = append(d.batchKills, batchKill{pid: pid, txs: txs})
		}
		if d.res.Kills[p.spec.Role] == nil {
			d.res.Kills[p.spec.Role] = map[string]int{}
		}
		d.res.Kills[p.spec.Role][phase]++
		if err := d.start(p); err != nil {
			return err
		}
		if (c+1)%50 == 0 {
			d.say("cycle %d/%d: %d messages placed", c+1, d.cfg.Cycles, d.next)
		}
	}
	if n := d.cfg.Messages - d.next; n > 0 {
		return d.place(ctx, n)
	}
	return nil
}

// place commits n logical messages to the outbox, each with a row in the
// placed table in the same transaction: that table is the truth of what was
// placed, even when a commit's outcome is unknown. A failed transaction is
// retried with new messages until ctx ends.
func (d *driver) place(ctx context.Context, n int) error {
	for {
		err := d.placeOnce(ctx, n)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
}

func (d *driver) placeOnce(ctx context.Context, n int) (err error) {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	pub, err := d.ob.TxPublisher(tx)
	if err != nil {
		return err
	}
	q := "INSERT INTO " + d.placed + " (seq, msg_id) VALUES (?, ?)"
	if d.dialect == sqldb.Postgres {
		q = "INSERT INTO " + d.placed + " (seq, msg_id) VALUES ($1, $2)"
	}
	msgs := make([]*message.Message, n)
	for i := range msgs {
		seq := d.next
		d.next++ // a failed transaction burns its numbers
		id := fmt.Sprintf("%s-%07d", d.runID, seq)
		if _, err := tx.ExecContext(ctx, q, seq, id); err != nil {
			return err
		}
		msgs[i] = message.NewMessage(id, []byte(fmt.Sprintf(`{"seq":%d}`, seq)))
	}
	if err := pub.Publish(d.topic, msgs...); err != nil {
		return err
	}
	return tx.Commit()
}

// errUnfinished is the error of a drain that ended before everything settled.
var errUnfinished = errors.New("reliability: drain did not finish")

// drain waits until every placed message has an effect, the outbox is
// forwarded, the queue is empty and the effect count has not moved for two
// seconds, restarting any process that exits. It gives up early when
// messages are missing but nothing is left to bring them: the outbox is
// forwarded, the queue is empty and no effect has come for a stall limit
// (five claim timeouts, at least 15s, so that the claims of killed
// consumers have lapsed and their deliveries come back).
func (d *driver) drain(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.DrainTimeout)
	defer cancel()
	d.say("draining")
	stallLimit := max(15*time.Second, 5*d.cfg.ClaimTimeout)
	var last, missing, pending, ready int
	var stable, stalled time.Time
	for {
		if err := d.checkExits(); err != nil {
			return err
		}
		effects, m, err := d.progress(ctx, -1)
		var st outbox.Status
		if err == nil {
			st, err = d.ob.Status(ctx)
		}
		var backlog int
		if err == nil {
			backlog, _, err = d.broker.depth(ctx)
		}
		if err == nil {
			missing, pending, ready = m, int(st.Pending), backlog
			switch {
			case missing > 0 && pending == 0 && ready == 0 && effects == last:
				stable = time.Time{}
				if stalled.IsZero() {
					stalled = time.Now()
				} else if time.Since(stalled) >= stallLimit {
					return fmt.Errorf("%w: %d messages without effect, the outbox forwarded and the queue empty, no effect for %v", errUnfinished, missing, stallLimit)
				}
			case missing > 0 || pending > 0 || ready > 0 || effects != last:
				stable, stalled = time.Time{}, time.Time{}
			case stable.IsZero():
				stable, stalled = time.Now(), time.Time{}
			case time.Since(stable) >= 2*time.Second:
				return nil
			}
			last = effects
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %d messages without effect, %d outbox rows pending, %d on the queue (last error: %v): %w",
				errUnfinished, missing, pending, ready, err, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// progress returns the number of effect rows and the number of placed
// messages (with seq <= upTo, or all when upTo < 0) that have none.
func (d *driver) progress(ctx context.Context, upTo int) (effects, missing int, err error) {
	if err = d.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+d.effects).Scan(&effects); err != nil {
		return 0, 0, err
	}
	q := "SELECT COUNT(*) FROM " + d.placed + " p WHERE NOT EXISTS (SELECT 1 FROM " + d.effects + " e WHERE e.msg_id = p.msg_id)"
	if upTo >= 0 {
		q += fmt.Sprintf(" AND p.seq <= %d", upTo)
	}
	err = d.db.QueryRowContext(ctx, q).Scan(&missing)
	return effects, missing, err
}

func (d *driver) count(ctx context.Context) error {
	r := &d.res
	qs := []struct {
		q   string
		dst *int
	}{
		{"SELECT COUNT(*) FROM " + d.placed, &r.Placed},
		{"SELECT COUNT(*) FROM " + d.effects, &r.Effects},
		{"SELECT COUNT(*) FROM " + d.placed + " p WHERE NOT EXISTS (SELECT 1 FROM " + d.effects + " e WHERE e.msg_id = p.msg_id)", &r.Lost},
		{"SELECT COUNT(*) FROM (SELECT msg_id FROM " + d.effects + " GROUP BY msg_id HAVING COUNT(*) > 1) x", &r.Duplicated},
		{"SELECT COUNT(*) - COUNT(DISTINCT msg_id) FROM " + d.effects, &r.Extra},
		{"SELECT COUNT(*) FROM " + d.effects + " e WHERE NOT EXISTS (SELECT 1 FROM " + d.placed + " p WHERE p.msg_id = e.msg_id)", &r.Unplaced},
		{"SELECT COALESCE(SUM(attempts), 0) FROM " + d.claims, &r.ClaimRuns},
	}
	for _, q := range qs {
		if err := d.db.QueryRowContext(ctx, q.q).Scan(q.dst); err != nil {
			return fmt.Errorf("reliability: count: %w", err)
		}
	}
	if d.cfg.Mode == ModeBatch {
		if err := d.countBatches(ctx); err != nil {
			return err
		}
	}
	if err := d.countZombies(ctx); err != nil {
		return err
	}
	var err error
	if r.LeftOnQueue, r.DeadLettered, err = d.broker.depth(ctx); err != nil {
		return fmt.Errorf("reliability: queue depth: %w", err)
	}
	return nil
}

// close stops the processes and removes the run's tables, queues and logs
// (the logs stay when keepLogs or Config.Keep).
func (d *driver) close(keepLogs bool) error {
	d.stopAll()
	for _, p := range d.procs {
		_ = p.log.Close()
	}
	if d.cfg.Keep {
		return d.db.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errs []error
	tables := []string{d.claims, d.effects, d.placed}
	if d.ob != nil {
		// The outbox's rows and its relays' heartbeats (outbox.Config.Topic).
		tables = append(tables, d.ob.Table(), d.ob.Table()+"_relays")
	}
	for _, t := range tables {
		if _, err := d.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, d.db.Close())
	errs = append(errs, d.broker.remove(ctx))
	if keepLogs {
		fmt.Fprintf(d.cfg.Out, "process logs kept in %s\n", d.dir)
	} else if d.dir != "" {
		errs = append(errs, os.RemoveAll(d.dir))
	}
	return errors.Join(errs...)
}

// proc is one campaign process, restarted after every kill.
type proc struct {
	spec   childSpec
	seed   uint64
	starts int
	log    *os.File
	cmd    *exec.Cmd
	done   chan struct{}
	err    error
}

// status returns the line the process last wrote in its status file: its
// phase, and for mid-batch the numbers of its open transactions. A read can
// overlap a write, so the line counts only when two reads in a row agree.
func (p *proc) status() string {
	f, err := os.Open(p.spec.StatusFile)
	if err != nil {
		return phaseStarting
	}
	defer f.Close()
	read := func() string {
		b := make([]byte, statusWidth)
		n, _ := f.ReadAt(b, 0)
		return strings.TrimSpace(string(b[:n]))
	}
	s := read()
	for range 3 {
		again := read()
		if again == s {
			break
		}
		s = again
	}
	if s == "" {
		return phaseStarting
	}
	return s
}

// parseStatus splits a status line into the phase and the transaction
// numbers that follow it.
func parseStatus(line string) (phase string, txs []int) {
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return phaseStarting, nil
	}
	for _, f := range fields[1:] {
		if n, err := strconv.Atoi(f); err == nil && n > 0 {
			txs = append(txs, n)
		}
	}
	return fields[0], txs
}

// batchKill is a kill that landed while the process reported open batches.
type batchKill struct {
	pid int
	txs []int
}

// awaitBatch waits, up to a second, until the consumer p reports a batch
// between its claim statement and its commit, and returns its status line
// (whatever it is when the wait ends).
func (d *driver) awaitBatch(ctx context.Context, p *proc) string {
	deadline := time.Now().Add(time.Second)
	for {
		line := p.status()
		if strings.HasPrefix(line, phaseBatch) || time.Now().After(deadline) || ctx.Err() != nil {
			return line
		}
		select {
		case <-p.done:
			return line
		case <-time.After(500 * time.Microsecond):
		}
	}
}

// countBatches counts the committed transactions and checks each kill that
// landed in a batch: did the transactions it reported commit?
func (d *driver) countBatches(ctx context.Context) error {
	r := &d.res
	rows, err := d.db.QueryContext(ctx, "SELECT n, COUNT(*) FROM (SELECT COUNT(*) AS n FROM "+d.effects+" GROUP BY pid, tx) x GROUP BY n")
	if err != nil {
		return fmt.Errorf("reliability: count batches: %w", err)
	}
	r.BatchSizes = map[int]int{}
	for rows.Next() {
		var size, n int
		if err := rows.Scan(&size, &n); err != nil {
			_ = rows.Close()
			return fmt.Errorf("reliability: count batches: %w", err)
		}
		r.BatchSizes[size] = n
		r.Transactions += n
		r.LargestBatch = max(r.LargestBatch, size)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return fmt.Errorf("reliability: count batches: %w", err)
	}
	for _, k := range d.batchKills {
		r.BatchKills++
		if len(k.txs) == 0 {
			continue // the numbers were cut short: cannot tell
		}
		q := "SELECT COUNT(*) FROM " + d.effects + " WHERE pid = " + strconv.Itoa(k.pid) + " AND tx IN ("
		for i, tx := range k.txs {
			if i > 0 {
				q += ", "
			}
			q += strconv.Itoa(tx)
		}
		var n int
		if err := d.db.QueryRowContext(ctx, q+")").Scan(&n); err != nil {
			return fmt.Errorf("reliability: count batches: %w", err)
		}
		if n == 0 {
			r.BatchKillsUncommitted++
		}
	}
	return nil
}

func (d *driver) start(p *proc) error {
	spec := p.spec
	spec.Seed = p.seed + uint64(p.starts)
	p.starts++
	// A fresh status file: the phase of the killed process is stale.
	_ = os.Remove(spec.StatusFile)
	js, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	cmd := d.cfg.Command()
	cmd.Env = append(os.Environ(), ChildEnv+"="+string(js))
	cmd.Stdout, cmd.Stderr = p.log, p.log
	fmt.Fprintf(p.log, "---- start %d at %s\n", p.starts, time.Now().Format(time.RFC3339Nano))
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("reliability: start %s: %w", spec.Name, err)
	}
	p.cmd, p.done, p.err = cmd, make(chan struct{}), nil
	go func(done chan struct{}) {
		p.err = cmd.Wait()
		close(done)
	}(p.done)
	return nil
}

// kill sends sig (SIGKILL, or SIGTERM for a graceful stop) to p and waits
// for it to exit; a process that has not exited 20s after a SIGTERM is
// killed.
func (d *driver) kill(p *proc, sig syscall.Signal) error {
	select {
	case <-p.done:
		return nil // exited already; checkExits counts it
	default:
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	if sig != syscall.SIGKILL {
		select {
		case <-p.done:
			return nil
		case <-time.After(20 * time.Second):
			d.say("%s did not stop within 20s of %v; killing it", p.spec.Name, sig)
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
		}
	}
	<-p.done
	return nil
}

// checkExits restarts every process that ended by itself, and counts it.
func (d *driver) checkExits() error {
	for _, p := range d.procs {
		select {
		case <-p.done:
		default:
			continue
		}
		d.res.UnexpectedExits++
		d.say("%s exited by itself (%v); restarting it; see its log", p.spec.Name, p.err)
		if err := d.start(p); err != nil {
			return err
		}
	}
	return nil
}

// stopAll stops the processes gracefully, and kills what is left after 10s.
func (d *driver) stopAll() {
	for _, p := range d.procs {
		if p.cmd != nil {
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.After(10 * time.Second)
	for _, p := range d.procs {
		if p.cmd == nil {
			continue
		}
		select {
		case <-p.done:
		case <-deadline:
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
			<-p.done
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// phases lists the phases in a fixed order for the summary.
var phases = []string{phaseStarting, phaseIdle, phaseHandler, phaseBatch, phaseEffect, phaseCommitted, phasePublishing, phasePublished}

func sortedPhases(m map[string]int) []string {
	var out []string
	for _, p := range phases {
		if m[p] > 0 {
			out = append(out, p)
		}
	}
	for p := range m {
		if !slices.Contains(phases, p) {
			out = append(out, p)
		}
	}
	return out
}
