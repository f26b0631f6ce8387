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
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
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
	phaseEffect     = "effect-unconfirm" // plain consumer: effect written, key not confirmed
	phaseCommitted  = "committed-unacked"
	phasePublishing = "mid-forward" // relay: publishing to RabbitMQ
	phasePublished  = "published-unmarked"
	statusWidth     = 24
)

// childSpec is everything a child process needs; the driver passes it in
// ChildEnv.
type childSpec struct {
	Role         string        `json:"role"`
	Name         string        `json:"name"`
	Mode         string        `json:"mode"`
	DB           string        `json:"db"`
	AMQP         string        `json:"amqp"`
	Topic        string        `json:"topic"`
	OutboxTopic  string        `json:"outbox_topic"`
	Claims       string        `json:"claims"`
	Effects      string        `json:"effects"`
	StatusFile   string        `json:"status_file"`
	Seed         uint64        `json:"seed"`
	MaxSleep     time.Duration `json:"max_sleep"`
	ClaimTimeout time.Duration `json:"claim_timeout"`
	MaxAttempts  int           `json:"max_attempts"`
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

func amqpConfig(url string) (amqp.Config, error) {
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		return amqp.Config{}, err
	}
	cfg := amqp.NewDurableQueueConfig(url)
	cfg.Marshaler = m
	cfg.Publish.ConfirmDelivery = true
	cfg.Consume.Qos.PrefetchCount = 8
	// Reconnect quickly after a broker restart; watermill-amqp's default
	// starts at 500ms and grows to 60s.
	cfg.Connection.Reconnect = &amqp.ReconnectConfig{
		BackoffInitialInterval:     100 * time.Millisecond,
		BackoffRandomizationFactor: 0.5,
		BackoffMultiplier:          1.5,
		BackoffMaxInterval:         2 * time.Second,
	}
	return cfg, nil
}

func childSetup(spec childSpec) (*sql.DB, dedupe.Dialect, *status, *sleeper, watermill.LoggerAdapter, error) {
	db, dialect, err := sqlurl.Open(spec.DB)
	if err != nil {
		return nil, "", nil, nil, nil, err
	}
	st, err := openStatus(spec.StatusFile)
	if err != nil {
		_ = db.Close()
		return nil, "", nil, nil, nil, err
	}
	sl := &sleeper{rnd: rand.New(rand.NewPCG(spec.Seed, uint64(os.Getpid()))), max: spec.MaxSleep}
	return db, dialect, st, sl, watermill.NewStdLoggerWithOut(os.Stderr, false, false), nil
}

// runRelay forwards the outbox to RabbitMQ. Its publisher reports the phases
// around each publish and sleeps after the broker's confirmation, widening
// the window in which a kill leaves a published row unmarked.
func runRelay(ctx context.Context, spec childSpec) error {
	db, dialect, st, sl, logger, err := childSetup(spec)
	if err != nil {
		return err
	}
	defer db.Close()
	defer st.close()
	cfg, err := amqpConfig(spec.AMQP)
	if err != nil {
		return err
	}
	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	ob, err := outbox.New(outbox.Config{Dialect: dialect, Topic: spec.OutboxTopic, Logger: logger})
	if err != nil {
		return err
	}
	relay, err := ob.NewRelay(db, &phasePublisher{Publisher: pub, st: st, sl: sl, ctx: ctx},
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
	db, dialect, st, sl, logger, err := childSetup(spec)
	if err != nil {
		return err
	}
	defer db.Close()
	defer st.close()
	cfg, err := amqpConfig(spec.AMQP)
	if err != nil {
		return err
	}
	pub, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	sub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: dialect, Table: spec.Claims})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Outermost: the phase between the handler's success (committed or
	// confirmed) and the ack, with a random sleep to widen it.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				st.set(phaseCommitted)
				sl.sleep(ctx)
			}
			st.set(phaseIdle)
			return out, err
		}
	})
	p, err := pipeline.New(router, pipeline.Config{
		Publisher:      pub,
		Store:          store,
		ClaimTimeout:   spec.ClaimTimeout,
		DisableTracing: true,
		Logger:         logger,
		Retry: middleware.RetryConfig{
			MaxAttempts:      spec.MaxAttempts,
			InProcessRetries: 1,
			InitialInterval:  20 * time.Millisecond,
			MaxInterval:      200 * time.Millisecond,
			RedeliveryDelay:  50 * time.Millisecond,
			DeferDelay:       50 * time.Millisecond,
		},
	})
	if err != nil {
		return err
	}
	insert := "INSERT INTO " + spec.Effects + " (msg_id, pid) VALUES (?, ?)"
	if dialect == dedupe.Postgres {
		insert = "INSERT INTO " + spec.Effects + " (msg_id, pid) VALUES ($1, $2)"
	}
	pid := os.Getpid()
	switch spec.Mode {
	case ModeTx:
		_, err = p.HandleTx("effect", spec.Topic, sub, nil, pipeline.TxConfig{DB: db},
			func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
				st.set(phaseHandler)
				sl.sleep(ctx)
				if _, err := tx.ExecContext(ctx, insert, msg.UUID, pid); err != nil {
					return err
				}
				return ctx.Err()
			})
	case ModePlain:
		_, err = p.Handle("effect", spec.Topic, sub, func(msg *message.Message) error {
			ctx := msg.Context()
			st.set(phaseHandler)
			sl.sleep(ctx)
			if _, err := db.ExecContext(ctx, insert, msg.UUID, pid); err != nil {
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
