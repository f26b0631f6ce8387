package pipeline

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/amqpcheck"
	"github.com/settle-go/settle/internal/natscheck"
	"github.com/settle-go/settle/middleware"
)

// Config configures a Pipeline: the settle stack that every handler added
// through it gets.
type Config struct {
	// Publisher publishes dead-letter and poison copies, and the messages
	// that handlers produce. Required. A delivery is acked once Publish has
	// returned nil for its copy or its output, so Publish must return only
	// when the broker has stored the message. On RabbitMQ use
	// amqpsub.Publisher (amqpsub.NewPublisher, from watermill-amqp's
	// configuration): it also fails a message the broker routed to no queue
	// (amqpsub.ErrUnroutable), which RabbitMQ confirms all the same. A
	// watermill-amqp Publisher reports such a message as published: one
	// without Publish.ConfirmDelivery (or Publish.Transactional) is refused
	// (middleware.ErrUnconfirmedPublisher), and one with it is accepted
	// with an error logged by each parking middleware built on it.
	Publisher message.Publisher
	// ParkInitializer declares the dead-letter and poison topics before
	// every copy is published to them (see middleware.ParkConfig.Initializer):
	// RabbitMQ drops, and still confirms, a message published to a queue
	// that does not exist. Defaults to each handler's subscriber when it
	// implements message.SubscribeInitializer (watermill-amqp's Subscriber,
	// amqpsub.Subscriber, watermill-sql's Subscriber), which declares a
	// parking topic as it declares the topics it consumes; else to
	// Publisher when it implements it; else nothing is declared.
	ParkInitializer message.SubscribeInitializer
	// DeadLetterTopic receives messages whose attempts are exhausted.
	// Defaults to "<subscribed topic>.dead_letter" per handler; with
	// ParkStore there is no default, and dead-lettered messages go to the
	// store only unless it is set.
	DeadLetterTopic string
	// PoisonTopic receives messages that fail permanently. Defaults to
	// "<subscribed topic>.poison" per handler; with ParkStore there is no
	// default, and poisoned messages go to the store only unless it is set.
	// It may equal DeadLetterTopic.
	PoisonTopic string
	// ParkStore, when set, records every message the pipeline's handlers
	// dead-letter or poison (plain, transactional and batch handlers alike),
	// whole, before the original is acked: usually a parked.Store on the
	// application's database, where operators find, group and replay
	// failures. It is middleware.ParkConfig.Store of both parking
	// middlewares; see there for the order (the record, then the copy on
	// DeadLetterTopic or PoisonTopic when set, then the ack) and for a
	// record that cannot be written (the delivery is deferred, not an
	// attempt). Each Park has StoreTimeout as its deadline. When it has a
	// Check(context.Context) error method (a parked.Store does: its
	// tables), New calls it, as for Store.
	ParkStore settle.ParkStore
	// Store keeps dedupe claims: a dedupe.MemoryStore for one process, a
	// dedupe.SQLStore to share them between processes. Nil turns dedupe
	// off for plain handlers. HandleTx and HandleBatchTx take it when their
	// TxConfig.Store is nil, and then need a *dedupe.SQLStore of their
	// driver (*dedupe.SQLStore[*sql.Tx] on sqldb.Std,
	// *dedupe.SQLStore[pgx.Tx] on sqldb.Pgx).
	Store dedupe.Store
	// Key derives the dedupe key. Defaults to the message UUID.
	Key dedupe.KeyFunc
	// ClaimTimeout is the dedupe claim lifetime without renewal. Defaults to
	// 30s; see dedupe.Config.
	ClaimTimeout time.Duration
	// RenewInterval is how often a running handler's claim is renewed.
	// Defaults to ClaimTimeout/3; see dedupe.Config.
	RenewInterval time.Duration
	// StoreTimeout bounds each call to the dedupe store
	// (dedupe.Config.StoreTimeout) and each call settle makes in a
	// transactional handler's transaction (TxConfig.CallTimeout, when that
	// is not set), and each Park of ParkStore: a database that does not
	// answer within it defers the delivery instead of holding it. Defaults to ClaimTimeout/2, and at
	// least 1s. Must be 0 or >= 10ms.
	StoreTimeout time.Duration
	// BusyDelay is how long a delivery whose key another worker holds waits
	// before it is nacked (deferred, not an attempt); in a transactional
	// handler also the pause before a transaction that lost its database
	// connection is run again (TxConfig.BusyDelay). Defaults to 1s;
	// settle.NoDelay for none. See dedupe.Config.
	BusyDelay time.Duration
	// UnavailableDelay is how long a delivery whose claim the store could not
	// answer waits before it is nacked (deferred, not an attempt, never
	// dead-lettered for it); it doubles while the store stays unavailable, up
	// to MaxUnavailableDelay. Defaults to 1s and 30s; settle.NoDelay for
	// none. See dedupe.Config.
	UnavailableDelay    time.Duration
	MaxUnavailableDelay time.Duration
	// NackDelay is how long a message whose dead-letter or poison copy could
	// not be published waits before it is nacked (deferred, not an attempt).
	// Defaults to 1s; settle.NoDelay for none. See middleware.ParkConfig.
	NackDelay time.Duration
	// Retry bounds the attempts; its zero value means settle's defaults (5
	// attempts, 2 in-process retries, backoff from 100ms, 1s before a failed
	// message is nacked). See middleware.RetryConfig. Its StoreCounts and
	// StoreInside are the pipeline's to set, per handler: StoreCounts for
	// those with the dedupe middleware, StoreInside for transactional ones
	// that write their keys themselves (TxConfig.OneStatement, Batch),
	// neither for the others.
	Retry middleware.RetryConfig
	// Tracing is given to middleware.NewTracing: settle.WithTracerProvider,
	// settle.WithMeterProvider, settle.WithPropagators, ... (the same
	// options as outbox.Config.Tracing).
	Tracing []settle.Option
	// DisableTracing leaves the tracing middleware out.
	DisableTracing bool
	// Concurrency is how many deliveries of each handler run at once. A
	// Watermill subscription hands its handler one message at a time, so a
	// handler bound by a database round trip is limited to one round trip's
	// worth of messages per second; with Concurrency N the handler subscribes
	// N times to its topic, as competing consumers (name, name#2, ...). Set
	// the broker's prefetch to at least 1 per subscription (watermill-amqp:
	// Consume.Qos.PrefetchCount is per channel, and each subscription has its
	// own). Only for brokers whose subscriptions of one topic share its
	// messages, such as RabbitMQ queues and SQL subscribers of one consumer
	// group: GoChannel gives every subscription every message, so it is
	// refused there. Defaults to 1. Must be >= 0 (0 means 1).
	//
	// A subscriber that hands its router several deliveries of one
	// subscription at once says how many with an InFlight() int method
	// (amqpsub.Subscriber does): a handler then has Concurrency times that
	// many in flight, which is what sizes its batches (TxConfig.Batch).
	Concurrency int
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.Retry.Logger == nil {
		c.Retry.Logger = c.Logger
	}
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
}

// validate reports the first invalid field. Nested configurations are checked
// by the constructors they are passed to, with their own field names.
func (c Config) validate() error {
	if c.Publisher == nil {
		return errors.New("pipeline: Config.Publisher is required")
	}
	if amqpcheck.Unconfirmed(c.Publisher) {
		return fmt.Errorf("pipeline: Config.Publisher: %w", middleware.ErrUnconfirmedPublisher)
	}
	if c.Concurrency < 0 {
		return fmt.Errorf("pipeline: Config.Concurrency must be >= 0, got %d", c.Concurrency)
	}
	if c.ClaimTimeout < 0 {
		return fmt.Errorf("pipeline: Config.ClaimTimeout must be >= 0, got %v", c.ClaimTimeout)
	}
	if c.RenewInterval < 0 {
		return fmt.Errorf("pipeline: Config.RenewInterval must be >= 0, got %v", c.RenewInterval)
	}
	if c.StoreTimeout < 0 || c.StoreTimeout > 0 && c.StoreTimeout < 10*time.Millisecond {
		return fmt.Errorf("pipeline: Config.StoreTimeout must be 0 (its default) or >= 10ms, got %v", c.StoreTimeout)
	}
	return nil
}

// storeTimeout is Config.StoreTimeout with its default: half the claim
// timeout (the dedupe middleware's default of 30s when that is not set),
// and at least 1s, as dedupe.Config.StoreTimeout's.
func (c Config) storeTimeout() time.Duration {
	if c.StoreTimeout > 0 {
		return c.StoreTimeout
	}
	ct := c.ClaimTimeout
	if ct == 0 {
		ct = 30 * time.Second
	}
	return max(ct/2, time.Second)
}

// Pipeline adds handlers to a Watermill router with settle's stack in the
// order of the design, from the outside in:
//
//	tracing -> poison parking -> dead-letter parking -> retry -> dedupe -> decode -> handler
//
// Attempts are counted per pipeline handler and message: with a Store, by
// the store (exact across processes); without one, as the retry middleware
// says (middleware.NewRetry). Trouble in the store or the parking topics
// defers a delivery and never counts as an attempt.
//
// Each piece is also a plain message.HandlerMiddleware of its own package,
// for routers assembled by hand (see package middleware: "Assembling the
// stack by hand").
type Pipeline struct {
	router       *message.Router
	cfg          Config
	tracing      message.HandlerMiddleware
	retry        message.HandlerMiddleware // for handlers without the dedupe middleware
	retryCounted message.HandlerMiddleware // StoreCounts: for handlers with it
	// StoreInside: for handlers that write their keys in their own
	// transactions (TxConfig.OneStatement, Batch), counted by the broker
	retryLooked message.HandlerMiddleware
}

// New returns a Pipeline that adds handlers to router. It checks every part
// of cfg now, so a bad configuration is refused before any message flows;
// for a *dedupe.SQLStore that includes its claims table
// (dedupe.SQLStore.Check, within 10 seconds), so that a missing migration is
// one clear error, with the DDL to run, instead of deferred deliveries.
func New(router *message.Router, cfg Config) (*Pipeline, error) {
	if router == nil {
		return nil, errors.New("pipeline: New: router is nil")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := checkStore(cfg.Store); err != nil {
		return nil, err
	}
	if c, ok := cfg.ParkStore.(interface{ Check(context.Context) error }); ok {
		if err := checkNow(c.Check); err != nil {
			return nil, fmt.Errorf("pipeline: Config.ParkStore: %w", err)
		}
	}
	p := &Pipeline{router: router, cfg: cfg}
	var err error
	// Handlers with the dedupe middleware have their runs counted by its
	// store (RetryConfig.StoreCounts), the others by the retry middleware.
	retry := cfg.Retry
	retry.StoreCounts = false
	if p.retry, err = middleware.NewRetry(retry); err != nil {
		return nil, err
	}
	retry.StoreCounts = true
	if p.retryCounted, err = middleware.NewRetry(retry); err != nil {
		return nil, err
	}
	// Handlers that write their keys in their own transactions count with
	// the broker, and answer a delivery that count leaves with no attempt:
	// a duplicate when its key is confirmed, dead-lettered unrun otherwise.
	retry.StoreCounts, retry.StoreInside = false, true
	if p.retryLooked, err = middleware.NewRetry(retry); err != nil {
		return nil, err
	}
	if !cfg.DisableTracing {
		if p.tracing, err = middleware.NewTracing(cfg.Tracing...); err != nil {
			return nil, err
		}
	}
	// Build the per-handler pieces once to check their configuration.
	if _, err := p.stack("check", "", nil, nil, false, false); err != nil {
		return nil, err
	}
	return p, nil
}

// noDeclarer stands for the subscriber of a handler not added yet.
type noDeclarer struct{}

func (noDeclarer) SubscribeInitialize(string) error { return nil }

// stack returns the middleware for one handler subscribed to topic on sub.
// store overrides cfg.Store when not nil. confirmInTx: the handler is
// transactional and confirms the dedupe claims in its transaction
// (dedupe.Config.ConfirmInTx).
func (p *Pipeline) stack(topic, publishTopic string, sub message.Subscriber, store dedupe.Store, noDedupe, confirmInTx bool) ([]message.HandlerMiddleware, error) {
	dlTopic, poisonTopic := p.cfg.DeadLetterTopic, p.cfg.PoisonTopic
	if dlTopic == "" && p.cfg.ParkStore == nil {
		dlTopic = topic + ".dead_letter"
	}
	if poisonTopic == "" && p.cfg.ParkStore == nil {
		poisonTopic = topic + ".poison"
	}
	initr := p.cfg.ParkInitializer
	if initr == nil {
		initr, _ = sub.(message.SubscribeInitializer)
	}
	if initr == nil && sub == nil {
		// New's check of the configuration: each handler's subscriber
		// is its declarer, and is checked when the handler is added.
		initr = noDeclarer{}
	}
	parking := func(topic string) middleware.ParkConfig {
		c := middleware.ParkConfig{Store: p.cfg.ParkStore, StoreTimeout: p.cfg.storeTimeout(), NackDelay: p.cfg.NackDelay, Logger: p.cfg.Logger}
		if topic != "" {
			c.Publisher, c.Topic, c.Initializer = p.cfg.Publisher, topic, initr
		}
		return c
	}
	ps, err := middleware.NewPoison(parking(poisonTopic))
	if err != nil {
		return nil, err
	}
	dl, err := middleware.NewDeadLetter(parking(dlTopic))
	if err != nil {
		return nil, err
	}
	var mws []message.HandlerMiddleware
	if p.tracing != nil {
		mws = append(mws, p.tracing)
	}
	mws = append(mws, ps, dl)
	if store == nil {
		store = p.cfg.Store
	}
	dedupeOn := store != nil && !noDedupe
	switch {
	case dedupeOn:
		mws = append(mws, p.retryCounted)
	case store != nil:
		// A transactional handler that claims its keys itself (addTx).
		mws = append(mws, p.retryLooked)
	default:
		mws = append(mws, p.retry)
	}
	if dedupeOn {
		var pub message.Publisher
		if publishTopic != "" {
			pub = p.cfg.Publisher
		}
		dd, err := dedupe.NewMiddleware(dedupe.Config{
			Store: store, Key: p.cfg.Key, ClaimTimeout: p.cfg.ClaimTimeout, RenewInterval: p.cfg.RenewInterval, StoreTimeout: p.cfg.StoreTimeout,
			BusyDelay: p.cfg.BusyDelay, UnavailableDelay: p.cfg.UnavailableDelay, MaxUnavailableDelay: p.cfg.MaxUnavailableDelay,
			Logger: p.cfg.Logger, Publisher: pub, ConfirmInTx: confirmInTx,
		})
		if err != nil {
			return nil, err
		}
		mws = append(mws, dd)
	} else if publishTopic != "" {
		// Without a store the output is published here too, not by the
		// router after the chain has returned: so a failed publish is a
		// failed run, as with a store, and the tracing middleware ends the
		// delivery's spans before the chain returns, which
		// router.Close waits for (see middleware.NewTracing).
		mws = append(mws, publishOutput(p.cfg.Publisher, publishTopic))
	}
	if p.tracing != nil && publishTopic != "" {
		// The dedupe middleware publishes the output itself: its messages
		// get their trace context before that, right at the handler.
		mws = append(mws, middleware.TraceProduced)
	}
	if publishTopic != "" {
		mws = append(mws, detachProduced)
	}
	return mws, nil
}

// checkStore checks a store that can check itself (a SQLStore: its claims
// table).
func checkStore(s dedupe.Store) error {
	c, ok := s.(interface{ Check(context.Context) error })
	if !ok {
		return nil
	}
	if err := checkNow(c.Check); err != nil {
		return fmt.Errorf("pipeline: Config.Store: %w", err)
	}
	return nil
}

// checkNow runs a table check where the pipeline is assembled, which takes
// no context, bounded by 10s.
func checkNow(check func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return check(ctx)
}

// publishOutput publishes the messages the handler returns to topic and
// returns none to the router.
func publishOutput(pub message.Publisher, topic string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && len(out) > 0 {
				if perr := pub.Publish(topic, out...); perr != nil {
					err = fmt.Errorf("pipeline: publish the handler's output to %q: %w", topic, perr)
				}
			}
			return nil, err
		}
	}
}

// Handlers are the router handlers of one Pipeline handler: one per
// subscription (see Config.Concurrency).
type Handlers []*message.Handler

// AddMiddleware adds middleware, inside settle's stack, to every one of them.
func (hs Handlers) AddMiddleware(m ...message.HandlerMiddleware) {
	for _, h := range hs {
		h.AddMiddleware(m...)
	}
}

// add registers Concurrency router handlers for one pipeline handler.
func (p *Pipeline) add(name string, sub message.Subscriber, mws []message.HandlerMiddleware, register func(name string) *message.Handler) (Handlers, error) {
	if _, fanOut := sub.(*gochannel.GoChannel); fanOut && p.cfg.Concurrency > 1 {
		return nil, fmt.Errorf("pipeline: handler %q: Concurrency %d needs competing consumers, and GoChannel gives every subscription every message", name, p.cfg.Concurrency)
	}
	p.checkNATS(name, sub)
	hs := make(Handlers, p.cfg.Concurrency)
	for i := range hs {
		n := name
		if i > 0 {
			n = fmt.Sprintf("%s#%d", name, i+1)
		}
		hs[i] = register(n)
		// The stack runs on the router's goroutine of each delivery. A pool
		// of workers that kept their grown stacks between deliveries was
		// measured against it and removed: go run ./bench -only stack -quick
		// -runs 1, both builds alternating, 30 rounds, 2026-12-02, load
		// average 13-28 on 2 cores: without the pool, settle's rate was 0.98
		// of its rate with it (median of the paired rounds, interquartile
		// range 0.70-1.52) and its CPU time per message 1.10 (0.97-1.28,
		// higher in 20 of 30 rounds): within the runs' noise.
		hs[i].AddMiddleware(mws...)
	}
	return hs, nil
}

// Handle adds a handler that consumes topic with the whole stack.
func (p *Pipeline) Handle(name, topic string, sub message.Subscriber, h message.NoPublishHandlerFunc) (Handlers, error) {
	mws, err := p.stack(topic, "", sub, nil, false, false)
	if err != nil {
		return nil, err
	}
	return p.add(name, sub, mws, func(n string) *message.Handler {
		return p.router.AddConsumerHandler(n, topic, sub, h)
	})
}

// HandleProducing adds a handler whose returned messages are published to
// publishTopic with cfg.Publisher, inside the stack (with dedupe on, before
// the key is confirmed): a failed publish is a failed run, retried, never
// lost. The router publishes nothing itself.
func (p *Pipeline) HandleProducing(name, topic string, sub message.Subscriber, publishTopic string, h message.HandlerFunc) (Handlers, error) {
	if publishTopic == "" {
		return nil, errors.New("pipeline: HandleProducing: publishTopic is required")
	}
	mws, err := p.stack(topic, publishTopic, sub, nil, false, false)
	if err != nil {
		return nil, err
	}
	return p.add(name, sub, mws, func(n string) *message.Handler {
		return p.router.AddHandler(n, topic, sub, publishTopic, p.cfg.Publisher, h)
	})
}

// HandleTx adds a transactional handler to p (see NewTxHandler): fn's
// writes, the messages it publishes through the outbox and the dedupe
// confirmation commit together. The messages continue the delivery's trace
// unless they carry a trace context of their own. Its claims are kept by
// cfg.Store, or by Config.Store when that is nil, which must then be a
// *dedupe.SQLStore[TTx] on cfg.DB's database. (Go methods take no type
// parameters, so it is a function and not a method of Pipeline.)
func HandleTx[TTx any](p *Pipeline, name, topic string, sub message.Subscriber, cfg TxConfig[TTx], fn TxFunc[TTx]) (Handlers, error) {
	return handleTx(p, "HandleTx", name, topic, sub, cfg, func(cfg TxConfig[TTx]) (message.NoPublishHandlerFunc, error) {
		return NewTxHandler(cfg, fn)
	})
}

// HandleBatchTx adds a batch handler to p (see NewBatchTxHandler and
// BatchTxFunc): the deliveries in flight, up to cfg.Batch.MaxSize (capped
// at the deliveries the handler can have in flight, see Config.Concurrency;
// there must be at least 2), are handed to fn together, and their writes,
// outbox messages and dedupe keys commit in one transaction. Its store is
// as for HandleTx.
func HandleBatchTx[TTx any](p *Pipeline, name, topic string, sub message.Subscriber, cfg TxConfig[TTx], fn BatchTxFunc[TTx]) (Handlers, error) {
	if err := p.canBatch("HandleBatchTx", name, sub, cfg.Batch); err != nil {
		return nil, err
	}
	return handleTx(p, "HandleBatchTx", name, topic, sub, cfg, func(cfg TxConfig[TTx]) (message.NoPublishHandlerFunc, error) {
		return NewBatchTxHandler(cfg, fn)
	})
}

// handleTx adds a transactional handler built by build from cfg, completed
// with the pipeline's store, key and busy delay.
func handleTx[TTx any](p *Pipeline, method, name, topic string, sub message.Subscriber, cfg TxConfig[TTx], build func(TxConfig[TTx]) (message.NoPublishHandlerFunc, error)) (Handlers, error) {
	if cfg.Store == nil {
		s, ok := p.cfg.Store.(*dedupe.SQLStore[TTx])
		if !ok {
			want := "*dedupe.SQLStore[" + reflect.TypeFor[TTx]().String() + "]"
			if p.cfg.Store == nil {
				return nil, fmt.Errorf("pipeline: %s %q needs a %s: set TxConfig.Store or Config.Store", method, name, want)
			}
			return nil, fmt.Errorf("pipeline: %s %q needs a %s (TxConfig.Store, or Config.Store), and Config.Store is a %T", method, name, want, p.cfg.Store)
		}
		cfg.Store = s
	} else if dedupe.Store(cfg.Store) != p.cfg.Store {
		if err := checkStore(cfg.Store); err != nil {
			return nil, err
		}
	}
	if cfg.BusyDelay == 0 {
		cfg.BusyDelay = p.cfg.BusyDelay
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = p.cfg.storeTimeout()
	}
	warnServerTimeouts(cfg, name, p.cfg.Logger)
	if cfg.Outbox != nil && cfg.DB != nil {
		// A missing outbox table is one clear error now, not a failure of
		// every delivery later.
		if err := checkNow(cfg.Outbox.Check); err != nil {
			return nil, fmt.Errorf("pipeline: %s %q: TxConfig.Outbox: %w", method, name, err)
		}
	}
	return p.addTx(name, topic, sub, cfg.Store, txSetup{
		batch: &cfg.Batch, oneStatement: &cfg.OneStatement, key: &cfg.Key,
		build: func() (message.NoPublishHandlerFunc, error) { return build(cfg) },
	})
}

// txSetup is what handleTx gives addTx: the fields of its configuration
// that the pipeline settles, and how to build the handler once they are.
type txSetup struct {
	batch        *BatchConfig
	oneStatement *bool
	key          *dedupe.KeyFunc
	build        func() (message.NoPublishHandlerFunc, error)
}

// addTx adds a transactional handler, whatever its driver; s is its claims
// store.
func (p *Pipeline) addTx(name, topic string, sub message.Subscriber, s dedupe.Store, ts txSetup) (Handlers, error) {
	if n := p.inFlight(sub); ts.batch.enabled() && ts.batch.MaxSize > n {
		// No more deliveries can be in flight; a batch of one is the
		// one-statement mode.
		ts.batch.MaxSize = n
		*ts.oneStatement = *ts.oneStatement || !ts.batch.enabled()
	}
	oneStatement := *ts.oneStatement || ts.batch.enabled()
	if oneStatement {
		if *ts.key == nil {
			*ts.key = p.cfg.Key
		}
	}
	h, err := ts.build()
	if err != nil {
		return nil, err
	}
	// Behind the middleware (the default mode) every claim is confirmed
	// in the handler's transaction: on PostgreSQL it is a lease whose
	// commit does not wait for the disk (dedupe.Config.ConfirmInTx). It
	// saves the delivery one WAL flush of two: dedupe's
	// BenchmarkConfirmInTx, same run, 16 goroutines, median of 4: 530
	// msgs/s waiting, 624 as a lease (+18%).
	mws, err := p.stack(topic, "", sub, s, oneStatement, !oneStatement)
	if err != nil {
		return nil, err
	}
	return p.add(name, sub, mws, func(n string) *message.Handler {
		return p.router.AddConsumerHandler(n, topic, sub, h)
	})
}

// inFlight is how many deliveries of one handler on sub can be in flight at
// once: one per subscription, times what a subscriber that hands its router
// several deliveries of a subscription at once reports.
func (p *Pipeline) inFlight(sub message.Subscriber) int {
	n := 1
	if s, ok := sub.(interface{ InFlight() int }); ok && s.InFlight() > 1 {
		n = s.InFlight()
	}
	return p.cfg.Concurrency * n
}

// canBatch reports why a batch handler of batch on sub cannot be added, or
// nil: a batch is the deliveries in flight at once, so there must be at
// least two.
func (p *Pipeline) canBatch(method, name string, sub message.Subscriber, batch BatchConfig) error {
	if n := p.inFlight(sub); !batch.enabled() || n < 2 {
		return fmt.Errorf("pipeline: %s %q needs TxConfig.Batch.MaxSize >= 2 and at least 2 deliveries in flight (Config.Concurrency, or a subscriber with InFlight); got %d and %d", method, name, batch.MaxSize, n)
	}
	return nil
}

// checkNATS logs what settle cannot rely on in a NATS subscriber: one of
// watermill-nats' used as it is, or a JetStream AckWait shorter than the
// claim timeout, under which the message of a consumer that died comes back
// while its claim still holds and is deferred until the claim lapses.
func (p *Pipeline) checkNATS(name string, sub message.Subscriber) {
	fields := watermill.LogFields{"handler": name}
	if problem := natscheck.Problem(sub); problem != "" {
		p.cfg.Logger.Error("pipeline: a NATS subscriber settle cannot vouch for", errors.New(problem), fields)
	}
	claim := p.cfg.ClaimTimeout
	if claim == 0 {
		claim = 30 * time.Second
	}
	if wait, ok := natscheck.AckWait(sub); ok && wait < claim {
		p.cfg.Logger.Error("pipeline: JetStream AckWait is shorter than the claim timeout", fmt.Errorf(
			"AckWait %v < ClaimTimeout %v: the message of a consumer that died comes back while its claim still holds, and is deferred (nacked again) until the claim lapses; and a handler running longer than AckWait has its message delivered again while it runs", wait, claim), fields)
	}
}
