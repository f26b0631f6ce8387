package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/settle-go/settle/dedupe"
)

// ScopeName is the OpenTelemetry instrumentation scope of the outbox's
// metrics.
const ScopeName = "github.com/settle-go/settle/outbox"

// RelayConfig configures a Relay.
type RelayConfig struct {
	// ConsumerGroup names the relay's position in the outbox. Relays of the
	// same group share the work: each row is forwarded by one of them. The
	// default group is "".
	ConsumerGroup string
	// PollInterval is how long the relay waits before looking again when the
	// outbox was empty: the lag of a quiet outbox. Defaults to 50ms. Must be
	// > 0.
	PollInterval time.Duration
	// AckDeadline is how long one forward may take before the row is
	// retried. Defaults to 30s, or 5s on SQLite, where the relay holds the
	// database's write lock until the forward is acked and the deadline must
	// stay below the busy timeout of other writers (10s in settle's DSN).
	// Must be > 0.
	AckDeadline time.Duration
	// RetryInterval is how long the relay waits before trying a row again
	// after its forward failed (the broker is down), and before querying
	// again after a database error. It keeps an outage from becoming a hot
	// loop of failing publishes and error logs. Defaults to 1s. Must be > 0.
	RetryInterval time.Duration
	// PoisonTopic receives, unchanged, rows that are not settle envelopes
	// (written by something else into the outbox table), so that they do not
	// block the relay; they are counted as failed. Defaults to the outbox
	// topic + "_poison".
	PoisonTopic string
	// CloseTimeout bounds Close. Defaults to 30s.
	CloseTimeout time.Duration
	// MeterProvider records settle.outbox.forwarded, settle.outbox.failed,
	// settle.outbox.pending and settle.outbox.lag. Defaults to the global
	// provider.
	MeterProvider metric.MeterProvider
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RelayConfig) setDefaults(topic string) {
	if c.PollInterval == 0 {
		c.PollInterval = 50 * time.Millisecond
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = 30 * time.Second
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = time.Second
	}
	if c.PoisonTopic == "" {
		c.PoisonTopic = topic + "_poison"
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field.
func (c RelayConfig) Validate() error {
	switch {
	case c.PollInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.PollInterval must be > 0, got %v", c.PollInterval)
	case c.AckDeadline <= 0:
		return fmt.Errorf("outbox: RelayConfig.AckDeadline must be > 0, got %v", c.AckDeadline)
	case c.RetryInterval <= 0:
		return fmt.Errorf("outbox: RelayConfig.RetryInterval must be > 0, got %v", c.RetryInterval)
	case c.CloseTimeout <= 0:
		return fmt.Errorf("outbox: RelayConfig.CloseTimeout must be > 0, got %v", c.CloseTimeout)
	}
	return nil
}

// Relay forwards committed outbox rows to the real publisher, in commit
// order, through Watermill's forwarder on a watermill-sql subscriber. A row
// is marked forwarded after the publisher accepted it; a relay killed in
// between forwards it again on restart, so downstream consumers must dedupe
// (settle's dedupe middleware does). Several relays of one consumer group can
// run at once: the offsets table serialises them.
type Relay struct {
	o      *Outbox
	db     wsql.Beginner
	cfg    RelayConfig
	fwd    *forwarder.Forwarder
	sub    *wsql.Subscriber
	out    message.Publisher
	attrs  metric.MeasurementOption
	reg    metric.Registration
	fwdCnt metric.Int64Counter
	fail   metric.Int64Counter

	forwarded atomic.Int64
	failed    atomic.Int64
}

// NewRelay returns a relay from the outbox on db to out. db is
// wsql.BeginnerFromStdSQL(sqlDB) or wsql.BeginnerFromPgx(pool). The relay
// does not own out: closing the relay leaves it open.
func (o *Outbox) NewRelay(db wsql.Beginner, out message.Publisher, cfg RelayConfig) (*Relay, error) {
	if db == nil || out == nil {
		return nil, errors.New("outbox: NewRelay: db and out are required")
	}
	if cfg.AckDeadline == 0 && o.cfg.Dialect == dedupe.SQLite {
		cfg.AckDeadline = 5 * time.Second
	}
	cfg.setDefaults(o.cfg.Topic)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ack := cfg.AckDeadline
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:  cfg.ConsumerGroup,
		PollInterval:   cfg.PollInterval,
		ResendInterval: cfg.RetryInterval,
		RetryInterval:  cfg.RetryInterval,
		AckDeadline:    &ack,
		SchemaAdapter:  o.schema,
		OffsetsAdapter: o.offsets,
	}, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("outbox: relay subscriber: %w", err)
	}
	r := &Relay{o: o, db: db, cfg: cfg, sub: sub, out: out}
	if err := r.instruments(); err != nil {
		_ = sub.Close()
		return nil, err
	}
	r.fwd, err = forwarder.NewForwarder(sub, o.traced(out), cfg.Logger, forwarder.Config{
		ForwarderTopic: o.cfg.Topic,
		Middlewares:    []message.HandlerMiddleware{r.settle},
		CloseTimeout:   cfg.CloseTimeout,
	})
	if err != nil {
		_ = sub.Close()
		_ = r.reg.Unregister()
		return nil, fmt.Errorf("outbox: forwarder: %w", err)
	}
	return r, nil
}

func (r *Relay) instruments() error {
	meter := r.cfg.MeterProvider.Meter(ScopeName)
	var err error
	attrs := attribute.NewSet(attribute.String("settle.outbox.topic", r.o.cfg.Topic), attribute.String("settle.outbox.consumer_group", r.cfg.ConsumerGroup))
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

// settle is the relay's only middleware. A row is forwarded first and
// looked at only when that fails: the forwarder already decodes every
// envelope, and decoding it a second time up front cost as much CPU again
// per message. A failed row that is not a forwarder envelope (written by
// something else into the outbox table) is published unchanged to the
// poison topic and acked: the forwarder would nack it forever and block
// every row behind it. Any other failure is returned, so the row is retried.
func (r *Relay) settle(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		ctx := context.WithoutCancel(msg.Context())
		if err == nil {
			r.forwarded.Add(1)
			r.fwdCnt.Add(ctx, 1, r.attrs)
			return out, nil
		}
		r.failed.Add(1)
		r.fail.Add(ctx, 1, r.attrs)
		if isEnvelope(msg.Payload) {
			return nil, err
		}
		r.cfg.Logger.Error("outbox: row is not a settle envelope; publishing it to the poison topic", nil, watermill.LogFields{
			"row_uuid": msg.UUID, "poison_topic": r.cfg.PoisonTopic,
		})
		if perr := r.out.Publish(r.cfg.PoisonTopic, msg.Copy()); perr != nil {
			return nil, fmt.Errorf("outbox: row %s is not an envelope, and publishing it to %q failed: %w", msg.UUID, r.cfg.PoisonTopic, perr)
		}
		return nil, nil
	}
}

// isEnvelope reports whether payload decodes as a forwarder envelope with a
// destination topic.
func isEnvelope(payload []byte) bool {
	var env struct {
		DestinationTopic string            `json:"destination_topic"`
		UUID             string            `json:"uuid"`
		Payload          []byte            `json:"payload"`
		Metadata         map[string]string `json:"metadata"`
	}
	return json.Unmarshal(payload, &env) == nil && env.DestinationTopic != ""
}

// Run forwards until ctx is cancelled or Close is called.
func (r *Relay) Run(ctx context.Context) error { return r.fwd.Run(ctx) }

// Running is closed once the relay is forwarding.
func (r *Relay) Running() chan struct{} { return r.fwd.Running() }

// Close stops the relay, waits for the forward in progress, and releases
// its subscriber and metric callback. The output publisher stays open.
func (r *Relay) Close() error {
	err := r.fwd.Close()
	return errors.Join(err, r.sub.Close(), r.reg.Unregister())
}

// Counts returns how many rows this relay forwarded and how many forwards
// failed (or were foreign rows set aside) since it was built.
func (r *Relay) Counts() (forwarded, failed int64) {
	return r.forwarded.Load(), r.failed.Load()
}

// Status is the outbox's Status for this relay's consumer group.
func (r *Relay) Status(ctx context.Context) (Status, error) {
	return r.o.Status(ctx, r.db, r.cfg.ConsumerGroup)
}

// Drain waits until no committed row is pending for this relay's consumer
// group (forwarded by this relay or another of its group). Tests and tools
// use it instead of sleeping.
func (r *Relay) Drain(ctx context.Context) error {
	t := time.NewTicker(r.cfg.PollInterval)
	defer t.Stop()
	for {
		st, err := r.Status(ctx)
		if err != nil {
			return err
		}
		if st.Pending == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("outbox: drain: %d rows still pending: %w", st.Pending, ctx.Err())
		case <-t.C:
		}
	}
}

// Forward forwards every committed row now and returns when the outbox is
// drained: a relay on demand, for tests, tools and cron jobs. It returns the
// number of rows forwarded.
func (o *Outbox) Forward(ctx context.Context, db wsql.Beginner, out message.Publisher, cfg RelayConfig) (int64, error) {
	r, err := o.NewRelay(db, out, cfg)
	if err != nil {
		return 0, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Running():
	case err := <-done:
		_ = r.Close()
		return 0, fmt.Errorf("outbox: forward: relay stopped: %w", err)
	}
	derr := r.Drain(ctx)
	cerr := r.Close()
	rerr := <-done
	n, _ := r.Counts()
	return n, errors.Join(derr, cerr, rerr)
}
