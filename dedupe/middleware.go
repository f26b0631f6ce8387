package dedupe

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// KeyFunc returns the dedupe key of a message. An error from it fails the
// delivery; return a *KeyError (or an error with a Permanent() bool method
// that returns true) when no retry can produce a key.
type KeyFunc func(*message.Message) (string, error)

// messageUUID is the default KeyFunc: the message's UUID.
func messageUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// MetadataKey returns a KeyFunc that reads the key from a metadata field,
// prefixed by prefix (for example MetadataKey("order_id", "order:")). A
// message without the field fails with a *KeyError wrapping ErrEmptyKey.
func MetadataKey(field, prefix string) KeyFunc {
	return func(msg *message.Message) (string, error) {
		v := msg.Metadata.Get(field)
		if v == "" {
			return "", &KeyError{Err: fmt.Errorf("%w: metadata field %q is missing or empty", ErrEmptyKey, field)}
		}
		return prefix + v, nil
	}
}

// Config configures the dedupe middleware.
type Config struct {
	// Store keeps the claims. Required. To share claims between processes it
	// must be a SQLStore (or another shared store), not a MemoryStore.
	Store Store
	// Key derives the key from a message. Defaults to the message's UUID.
	Key KeyFunc
	// Scope names the logical handler the key belongs to; the stored key is
	// ScopedKey(Scope(msg), Key(msg)), so each handler of a message does its
	// work once even when several handlers consume the same message.
	// Defaults to HandlerScope (the Watermill handler's name, competing
	// subscriptions name#2... included in name's scope). Use SharedScope to
	// make handlers share keys on purpose.
	Scope ScopeFunc
	// ClaimTimeout is how long a claim lives without renewal: how soon a
	// crashed worker's message can be taken over by another. The claim of a
	// running handler is renewed, so it does not limit handler duration.
	// Defaults to 30s. Must be >= 10ms.
	ClaimTimeout time.Duration
	// RenewInterval is how often a running handler's claim is renewed.
	// Defaults to ClaimTimeout/3. Must be > 0 and < ClaimTimeout.
	RenewInterval time.Duration
	// SettleTimeout bounds each Confirm and Release call, which run even
	// when the message's context was cancelled (router shutdown) so that a
	// finished handler is recorded and a failed one frees its key. A
	// Confirm the store could not take after the handler succeeded is tried
	// again until the store answers, holding the delivery (see the package
	// documentation). Defaults to 5s, or StoreTimeout when that is shorter.
	// Must be > 0.
	SettleTimeout time.Duration
	// StoreTimeout bounds every other call to the store: each Claim, each
	// renewal, and the hold and confirmation of the claim in the handler's
	// transaction (HoldTx, ConfirmTx). A store that does not answer within
	// it (a database behind a silent network partition) defers the
	// delivery, as any store failure does, instead of holding it for as
	// long as the connection takes to die. A store on SQLite, a file of
	// this machine that no partition can cut off, and a MemoryStore have
	// none. Defaults to ClaimTimeout/2, and at least 1s: a busy database
	// may well take longer than a few milliseconds, and a bound shorter than
	// its worst answer would defer healthy deliveries. Must be >= 10ms; keep it
	// below ClaimTimeout, since a claim that took longer to take has
	// lapsed when it arrives.
	StoreTimeout time.Duration
	// Logger receives renewal failures and lost claims. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Publisher publishes the messages a handler returns, to the handler's
	// publish topic, before the key is confirmed. The router would otherwise
	// publish them only after the confirmation, and if that publish failed,
	// the redelivery would be a duplicate and the messages would be lost.
	// Required only for handlers that return messages: without it, such a
	// handler's delivery fails permanently with an *OutputError wrapping
	// ErrOutputWithoutPublisher, after its key is confirmed (the handler's
	// other effects are done and must not be done again), so the poison
	// parking in front parks it, and a router with no parking acks its
	// redelivery as a duplicate: one run, never a redelivery loop, and the
	// messages are dropped loudly (the error, and an Error log), never
	// silently. Prefer the transactional outbox where the messages must
	// commit with the handler's writes.
	Publisher message.Publisher
	// BusyDelay is how long a delivery whose key another worker holds is
	// held before it is nacked, so that it does not spin; it is deferred, not
	// an attempt. A delivery whose broker holds a nack itself (NATS
	// JetStream through package natsjs) is nacked that much sooner, here and
	// for UnavailableDelay. Defaults to 1s when zero; settle.NoDelay nacks at once.
	// Must be >= 0 or settle.NoDelay.
	BusyDelay time.Duration
	// UnavailableDelay is how long a delivery whose claim the store could not
	// answer (database down, claims table missing) is held before it is
	// nacked; it is deferred, never an attempt and never dead-lettered for
	// that reason. The delay doubles with each such claim in a row, up to
	// MaxUnavailableDelay. Defaults to 1s when zero; settle.NoDelay nacks at
	// once. Must be >= 0 or settle.NoDelay.
	UnavailableDelay time.Duration
	// MaxUnavailableDelay caps UnavailableDelay's growth. Defaults to 30s.
	// Must be >= UnavailableDelay.
	MaxUnavailableDelay time.Duration
	// ConfirmInTx says that the handler confirms every claim inside its own
	// transaction on the store's database (ConfirmTx) and that all its
	// effects are writes in that transaction: pipeline's transactional
	// handlers in their default mode set it. On PostgreSQL the claim is
	// then a lease whose commit does not wait for its WAL to reach disk
	// (synchronous_commit off, for the claim's statement alone): the
	// commit that confirms it does wait, and flushes the claim's WAL with
	// its own, which comes after it. What a crash of the database can lose
	// is a claim whose transaction it killed too: nothing of that attempt
	// landed, and its redelivery claims the key afresh, with the attempt
	// count one lower than it would be. A renewal, a release, a claim in a
	// caller's transaction (SQLStore.WithTx) and a claim on a partitioned
	// table (SQLConfig.Partition) commit as usual. It changes
	// nothing on MySQL/MariaDB and SQLite. Leave it unset for a handler
	// with any effect outside the database (an e-mail, an HTTP call), whose
	// attempt count must survive a crash of the database.
	ConfirmInTx bool
}

func (c *Config) setDefaults() {
	c.BusyDelay = settlement.Delay(c.BusyDelay, time.Second)
	c.UnavailableDelay = settlement.Delay(c.UnavailableDelay, time.Second)
	if c.MaxUnavailableDelay == 0 {
		c.MaxUnavailableDelay = max(30*time.Second, c.UnavailableDelay)
	}
	if c.Key == nil {
		c.Key = messageUUID
	}
	if c.Scope == nil {
		c.Scope = HandlerScope
	}
	if c.ClaimTimeout == 0 {
		c.ClaimTimeout = 30 * time.Second
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.ClaimTimeout / 3
	}
	if c.StoreTimeout == 0 {
		c.StoreTimeout = max(c.ClaimTimeout/2, time.Second)
	}
	if c.SettleTimeout == 0 {
		c.SettleTimeout = 5 * time.Second
		if c.StoreTimeout > 0 && networked(c.Store) {
			c.SettleTimeout = min(c.SettleTimeout, c.StoreTimeout)
		}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
	switch {
	case c.Store == nil:
		return errors.New("dedupe: Config.Store is required")
	case c.ClaimTimeout < 10*time.Millisecond:
		return fmt.Errorf("dedupe: Config.ClaimTimeout must be >= 10ms, got %v", c.ClaimTimeout)
	case c.RenewInterval <= 0 || c.RenewInterval >= c.ClaimTimeout:
		return fmt.Errorf("dedupe: Config.RenewInterval must be > 0 and < ClaimTimeout (%v), got %v", c.ClaimTimeout, c.RenewInterval)
	case c.SettleTimeout <= 0:
		return fmt.Errorf("dedupe: Config.SettleTimeout must be > 0, got %v", c.SettleTimeout)
	case c.StoreTimeout < 10*time.Millisecond:
		// Below that no database answers, and every delivery would be
		// deferred for ever without a run (a unit mistaken, as 5 for 5s).
		return fmt.Errorf("dedupe: Config.StoreTimeout must be >= 10ms, got %v", c.StoreTimeout)
	case c.BusyDelay < 0:
		return fmt.Errorf("dedupe: Config.BusyDelay must be >= 0 or settle.NoDelay, got %v", c.BusyDelay)
	case c.UnavailableDelay < 0:
		return fmt.Errorf("dedupe: Config.UnavailableDelay must be >= 0 or settle.NoDelay, got %v", c.UnavailableDelay)
	case c.MaxUnavailableDelay < c.UnavailableDelay:
		return fmt.Errorf("dedupe: Config.MaxUnavailableDelay must be >= UnavailableDelay (%v), got %v", c.UnavailableDelay, c.MaxUnavailableDelay)
	}
	return nil
}

// ErrOutputWithoutPublisher is wrapped by the error (an *OutputError,
// permanent) of a delivery whose handler returned messages while
// Config.Publisher is not set; see Config.Publisher.
var ErrOutputWithoutPublisher = errors.New("dedupe: handler returned messages but Config.Publisher is not set")

// ClaimFromContext returns the claim the dedupe middleware took for the
// message being handled. The handler sees it in msg.Context(); middleware
// outside dedupe sees it there after the handler returns.
func ClaimFromContext(ctx context.Context) (Claim, bool) {
	h, ok := ctx.Value(heldCtxKey{}).(*held)
	if !ok {
		return Claim{}, false
	}
	return h.claim, true
}

// NewMiddleware returns middleware that runs the handler at most once to
// success per key:
//
//   - Acquired: the handler runs while the claim is renewed in the
//     background; on success the key is confirmed, on error (or panic) it is
//     released so that a redelivery can do the work.
//   - Duplicate: the message is acked without running the handler.
//   - Busy: the delivery is deferred: held for BusyDelay, then an error
//     wrapping ErrBusy is returned so the message is nacked and redelivered
//     later; it is never acked, because if the holder dies this delivery
//     must do the work.
//   - Refused (a key that a transactional handler writing its own keys
//     refused, SQLStore.Refuse: its message was dead-lettered without a
//     run): an error wrapping ErrAttemptsUsedUp, which the retry middleware
//     dead-letters; the handler does not run.
//
// Before any claim, a replayed copy addressed to another handler
// (settle.MetaReplayHandler names a handler other than this one) is acked as
// a duplicate, unclaimed and unrun.
//
// A claim the store cannot answer defers the delivery too (an error wrapping
// ErrUnavailable, after UnavailableDelay growing to MaxUnavailableDelay).
// Deferrals are not attempts. When the retry middleware runs outside, the
// key's durable acquisition count is the attempt count, and a key acquired
// more often than its MaxAttempts does not start the handler (an error
// wrapping ErrAttemptsUsedUp) but goes to the dead-letter parking.
//
// If the claim is lost while the handler runs (a renewal finds another
// owner, or renewals keep failing until the claim expires), the handler's
// context is cancelled with a cause that wraps ErrClaimLost.
func NewMiddleware(cfg Config) (message.HandlerMiddleware, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	_, local := cfg.Store.(inProcess)
	m := &mw{cfg: cfg, local: local, networked: networked(cfg.Store), health: newDeferral(cfg.Logger), schedule: &schedule{interval: cfg.RenewInterval}}
	return m.wrap, nil
}

type mw struct {
	cfg Config
	// local: the store never waits on I/O (MemoryStore), so settling needs
	// no timeout of its own.
	local bool
	// networked: the store's calls cross a network, and get StoreTimeout.
	networked bool
	health    *deferral
	// schedule runs the claim renewals of the handlers running.
	schedule *schedule
	// uncounted: errRetryCountsToo was logged.
	uncounted atomic.Bool
}

// errRetryCountsToo is logged, once per middleware, when a retry middleware
// outside sets an attempt limit without RetryConfig.StoreCounts: it also
// counts attempts from its own sources (the broker's delivery count), and
// may dead-letter a message without a run that the store would still run.
var errRetryCountsToo = errors.New("the retry middleware counts attempts from its own sources too")

// inProcess is implemented by stores whose calls never wait on I/O.
type inProcess interface{ inProcess() }

// networked reports whether s's calls cross a network, and so get
// StoreTimeout: not a store in the process, nor one on SQLite.
func networked(s Store) bool {
	if _, ok := s.(inProcess); ok || s == nil {
		return false
	}
	if sb, ok := s.(sqlBacked); ok && sb.sqlDialect() == sqldb.SQLite {
		return false
	}
	return true
}

func (m *mw) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if m.forAnother(msg) {
			return nil, nil
		}
		key, own, err := messageKey(msg, m.cfg.Key, m.cfg.Scope)
		if err != nil {
			return nil, fmt.Errorf("dedupe: key of message %s: %w", msg.UUID, err)
		}
		orig := msg.Context()
		// The key as the key function gave it, for a parking middleware
		// outside that records the message.
		settlement.FromContext(orig).SetKey(own)
		// No attempt left by the retry middleware's own count (the
		// broker's; RetryConfig.StoreInside): the claim only says whether
		// an earlier delivery confirmed the key.
		last := settlement.FromContext(orig).NoAttemptLeft()
		claim, err := m.claim(orig, key)
		if err == nil && claim.Result == Acquired && orig.Err() != nil {
			err = m.giveBack(orig, claim)
		}
		if err != nil {
			return nil, m.unavailable(msg, orig, err)
		}
		m.health.claimed()
		st := &held{claim: claim, store: m.cfg.Store, ttl: m.cfg.ClaimTimeout, timeout: m.storeTimeout()}
		st.ctx = context.WithValue(orig, heldCtxKey{}, st)
		msg.SetContext(st.ctx)
		if claim.Result != Acquired {
			return nil, m.notAcquired(msg, orig, claim)
		}
		if rec := settlement.FromContext(orig); rec != nil {
			rec.SetFirstAttempt(claim.FirstAt)
			limit, storeCounts := rec.Limit()
			if limit > 0 && !storeCounts && m.uncounted.CompareAndSwap(false, true) {
				m.cfg.Logger.Error("dedupe: the retry middleware outside does not leave the attempt count to the store; set middleware.RetryConfig.StoreCounts",
					errRetryCountsToo, watermill.LogFields{"handler": message.HandlerNameFromCtx(orig)})
			}
			if limit > 0 && (claim.Attempt > limit || last) {
				rec.Refuse(claim.Attempt)
				return nil, m.overLimit(orig, claim, limit)
			}
			rec.Count(claim.Attempt)
			if n := strconv.Itoa(claim.Attempt); msg.Metadata.Get(settle.MetaAttempt) != n {
				msg.Metadata.Set(settle.MetaAttempt, n) // the handler sees the durable count
			}
		}
		return m.run(h, msg, orig, st)
	}
}

// storeTimeout is the deadline of a store call; 0 for a store that no
// network partition can cut off (see networked).
func (m *mw) storeTimeout() time.Duration {
	if !m.networked {
		return 0
	}
	return m.cfg.StoreTimeout
}

// claim claims key, bounded by StoreTimeout: a store that cannot answer
// defers the delivery within that bound.
//
// The claim does not end with the delivery's context: a shutdown that
// cancelled the statement after the server had written the row would leave
// the key claimed, unknown to anyone, and its redelivery busy for the whole
// claim timeout. A claim made while the delivery was cancelled is given back
// at once (giveBack).
func (m *mw) claim(ctx context.Context, key string) (Claim, error) {
	ctx = context.WithoutCancel(ctx)
	if d := m.storeTimeout(); d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	if m.cfg.ConfirmInTx {
		ctx = asLease(ctx)
	}
	return m.cfg.Store.Claim(ctx, key, m.cfg.ClaimTimeout)
}

// giveBack releases a claim acquired for a delivery that was cancelled
// meanwhile (the router is shutting down), so that its redelivery finds
// the key free; the handler does not run. It returns the error that
// defers the delivery.
func (m *mw) giveBack(orig context.Context, claim Claim) error {
	if err := m.settle(orig, claim, false); err != nil {
		return errors.Join(context.Cause(orig), err)
	}
	return context.Cause(orig)
}

// forAnother reports whether msg is a replayed copy addressed to another
// handler (settle.MetaReplayHandler), and then settles it as a duplicate:
// acked, not claimed, the handler not run.
func (m *mw) forAnother(msg *message.Message) bool {
	ctx := msg.Context()
	to, other := replay.ForAnother(message.HandlerNameFromCtx(ctx), msg.Metadata)
	if !other {
		return false
	}
	settlement.FromContext(ctx).SetOutcome(settlement.Duplicate)
	m.cfg.Logger.Debug("dedupe: replayed copy for another handler acked without running the handler", watermill.LogFields{
		"message_uuid": msg.UUID, "handler": message.HandlerNameFromCtx(ctx), "replay_handler": to,
	})
	return true
}

// notAcquired settles a delivery whose key is a duplicate (acked, nil),
// refused (an error wrapping ErrAttemptsUsedUp, dead-lettered by the retry
// middleware without a run) or busy (an error wrapping ErrBusy). The rare
// paths live apart from wrap's closure, to keep its stack frame small.
func (m *mw) notAcquired(msg *message.Message, orig context.Context, claim Claim) error {
	switch claim.Result {
	case Duplicate:
		settlement.FromContext(orig).SetOutcome(settlement.Duplicate)
		m.cfg.Logger.Debug("dedupe: duplicate acked without running the handler", watermill.LogFields{
			"message_uuid": msg.UUID, "attempt": claim.Attempt,
		})
		return nil
	case Refused:
		// A transactional handler that writes its keys itself refused the
		// key (SQLStore.Refuse): its message was dead-lettered without a
		// run, and so is this delivery.
		rec := settlement.FromContext(orig)
		limit, _ := rec.Limit()
		rec.Refuse(max(limit, claim.Attempt) + 1)
		return fmt.Errorf("%w: message %s, key refused by an earlier delivery with no attempt left", ErrAttemptsUsedUp, msg.UUID)
	}
	return m.busy(msg, orig)
}

// overLimit releases a claim acquired beyond the attempt limit.
func (m *mw) overLimit(orig context.Context, claim Claim, limit int) error {
	if err := m.settle(orig, claim, false); err != nil {
		return err
	}
	return fmt.Errorf("%w: %d attempts made, limit is %d", ErrAttemptsUsedUp, claim.Attempt-1, limit)
}

// run runs the handler under an acquired claim. st is orig carrying the
// claim; it is the message's context again once the handler has returned, so
// outer middleware can read the claim.
func (m *mw) run(h message.HandlerFunc, msg *message.Message, orig context.Context, st *held) (out []*message.Message, err error) {
	claim := st.claim
	hctx := &st.hctx
	hctx.h = st
	msg.SetContext(hctx)
	m.renew(hctx, &st.ren, msg.UUID, claim)

	settled := false
	defer func() {
		st.stopRenew()
		hctx.end()
		msg.SetContext(st.ctx)
		if !settled {
			// The handler panicked: free the key, then let the panic go on to
			// the recoverer.
			_ = m.settle(orig, claim, false)
		}
	}()

	out, err = h(msg)
	if err != nil && !errors.Is(err, ErrClaimLost) {
		// A handler cancelled because its claim was lost often returns just
		// its context's error (context.Canceled, or a driver's word for it).
		if cause := context.Cause(hctx); errors.Is(cause, ErrClaimLost) {
			err = fmt.Errorf("%w: %w", cause, err)
		}
	}
	if err != nil && renewalsFailed(hctx) {
		// The claim lapsed because the store could not renew it: the
		// store's trouble, not a spent attempt.
		settlement.FromContext(orig).Defer()
	}
	unpublished := 0 // messages returned with no Publisher to send them
	if err == nil && len(out) > 0 {
		if m.cfg.Publisher == nil {
			unpublished = len(out)
		} else {
			err = m.publish(msg, out)
		}
		out = nil
	}
	st.stopRenew()
	settled = true
	if err == nil && st.confirmedInTx {
		// The handler's transaction committed the confirmation.
		return nil, m.withoutPublisher(msg, unpublished)
	}
	var serr error
	if err == nil {
		serr = m.confirm(orig, msg.UUID, claim)
	} else {
		serr = m.settle(orig, claim, false)
	}
	if serr != nil {
		if err != nil {
			return nil, errors.Join(err, serr)
		}
		settlement.FromContext(orig).Defer() // the handler succeeded: not a failed attempt
		return nil, serr
	}
	if err == nil {
		err = m.withoutPublisher(msg, unpublished)
	}
	return out, err
}

// withoutPublisher is the result of a delivery whose handler succeeded and
// returned n messages (n > 0) with no Config.Publisher to send them: an
// OutputError, permanent, so that the poison parking in front parks the
// delivery on its first failure and nothing retries it. Its key is
// confirmed first (run does), because the handler's other effects are done
// and must not happen again: a redelivery is a duplicate, acked without a
// run, which also ends the loop of a router with no parking at all. The
// messages are dropped, and said so in the error and the log. n == 0: nil.
func (m *mw) withoutPublisher(msg *message.Message, n int) error {
	if n == 0 {
		return nil
	}
	err := &OutputError{Messages: n, Topic: message.PublishTopicFromCtx(msg.Context())}
	m.cfg.Logger.Error("dedupe: handler returned messages but Config.Publisher is not set; they were not published, the key is confirmed and the delivery fails permanently", err, watermill.LogFields{
		"message_uuid": msg.UUID, "handler": message.HandlerNameFromCtx(msg.Context()), "messages": n,
	})
	return err
}

// OutputError is the error of a delivery whose handler returned messages
// while Config.Publisher was not set. It wraps ErrOutputWithoutPublisher and
// is permanent (it has a Permanent method that returns true): the same
// handler returns messages again on every run, and no retry can publish
// them. The middleware confirms the key before returning it, since the
// handler's other effects happened: a redelivery, or a replay of the
// poisoned copy, is a duplicate and does not run the handler again.
type OutputError struct {
	Messages int    // how many messages the handler returned
	Topic    string // the handler's publish topic; empty when it has none
}

func (e *OutputError) Error() string {
	return fmt.Sprintf("%v: %d message(s) for topic %q dropped; the handler's key is confirmed, so its effects are not done again (set Config.Publisher)",
		ErrOutputWithoutPublisher, e.Messages, e.Topic)
}

// Unwrap returns ErrOutputWithoutPublisher.
func (e *OutputError) Unwrap() error { return ErrOutputWithoutPublisher }

// Permanent reports true.
func (e *OutputError) Permanent() bool { return true }

type heldCtxKey struct{}

// held is the middleware's claim as the handler sees it through ConfirmTx.
// It is also the context that carries it: the message's context with one more
// value, without a context.WithValue of its own.
type held struct {
	ctx           context.Context // the message's context with the claim
	claim         Claim
	store         Store
	ttl           time.Duration // the claim timeout, for HoldTx
	timeout       time.Duration // StoreTimeout, for HoldTx and ConfirmTx; 0 for none
	ren           renewal       // allocated with the holder; started while the handler runs
	hctx          handlerCtx    // the handler's context, allocated with the holder
	confirmedInTx bool
	// guessedRC: HoldTx took the transaction to be READ COMMITTED from the
	// transactions before it, without asking (holdPostgres).
	guessedRC bool
}

// handlerCtx is the handler's context: its parent h (the message's context
// with the claim), cancelled with a cause wrapping ErrClaimLost when the
// claim is lost, and cancelled when the handler has returned.
//
// The cancellable context (context.WithCancelCause of h) is made only when
// something needs it: a call to Done (a select, a child context, a database
// call), a lost claim, or Value after the handler returned (context.Cause).
// Until then Err and Value answer from h and the state recorded here. Most
// handlers finish before a renewal could lose their claim, and a handler that
// never waits on its context then costs no context allocation, no
// registration with the parent and no cancellation.
//
// What that saves was measured with go run ./bench -only stack -quick -runs 1,
// builds with and without it alternating in one session (2026-12-02, load
// average 13-28 on 2 cores): settle's stack (memory store, no tracing) made
// 43.0-44.0 allocations per message as it was (32 rounds), 44.1-44.5 with
// plain context.WithValue for the settlement record or for the claim's
// holder (3 rounds each, as they now are), and 50.1-51.0, about 570 B more
// per message, with both and context.WithCancelCause in this context's
// place (11 rounds): this one saves about 5 allocations and 450 B per
// message (the bare router makes 36). Rates and CPU time per message
// differed by less than the runs' noise (paired runs scattered by ±40%).
type handlerCtx struct {
	h     *held
	made  atomic.Bool // inner and cancel are set, and never change again
	ended atomic.Bool // the handler has returned

	mu     sync.Mutex
	inner  context.Context
	cancel context.CancelCauseFunc
}

// Deadline is the parent's: losing the claim has no deadline.
func (c *handlerCtx) Deadline() (time.Time, bool) { return c.h.ctx.Deadline() }

// Done returns the cancellable context's channel, making it on first use.
func (c *handlerCtx) Done() <-chan struct{} { return c.materialize().Done() }

// Err is the cancellable context's error once it is made; before that,
// Canceled once the handler has returned, else the parent's.
func (c *handlerCtx) Err() error {
	if c.made.Load() {
		return c.inner.Err()
	}
	if c.ended.Load() {
		return context.Canceled
	}
	return c.h.ctx.Err()
}

// Value returns the claim's holder for heldCtxKey. Other keys go to the
// cancellable context once it is made (it answers context.Cause's key with
// itself), and to the parent before: until it is made, the context has not
// been cancelled by the claim, so the parent's cause is the cause.
func (c *handlerCtx) Value(key any) any {
	if _, ok := key.(heldCtxKey); ok {
		return c.h
	}
	if c.made.Load() || c.ended.Load() {
		return c.materialize().Value(key)
	}
	return c.h.ctx.Value(key)
}

// String names the context (fmt, and context's own String of a child).
func (c *handlerCtx) String() string { return "dedupe.handlerContext" }

// materialize returns the cancellable context, making it (cancelled, if the
// handler has returned) the first time.
func (c *handlerCtx) materialize() context.Context {
	if c.made.Load() {
		return c.inner
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inner == nil {
		c.inner, c.cancel = context.WithCancelCause(c.h.ctx)
		if c.ended.Load() {
			c.cancel(nil)
		}
		c.made.Store(true)
	}
	return c.inner
}

// lose cancels the handler's context with cause: its claim is lost.
func (c *handlerCtx) lose(cause error) {
	c.materialize()
	c.cancel(cause)
}

// end cancels the handler's context: the handler has returned.
func (c *handlerCtx) end() {
	c.mu.Lock()
	c.ended.Store(true)
	cancel := c.cancel
	c.mu.Unlock()
	if cancel != nil {
		cancel(nil)
	}
}

// bounded is ctx with the store's deadline for one call in the handler's
// transaction: on database/sql and pgx a statement whose context ends is
// abandoned and its connection closed, which rolls the transaction back.
func (h *held) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if h.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, h.timeout)
}

// stopRenew stops the renewal of the claim, if any; it may be called twice.
func (h *held) stopRenew() { h.ren.stop() }

// sqlBacked is a store whose statements can run in a caller's
// transaction: a *SQLStore of any driver.
type sqlBacked interface {
	sqlDialect() sqldb.Dialect
	txType() string
}

func (s *SQLStore[TTx]) sqlDialect() sqldb.Dialect { return s.dialect }

// txType names TTx, for the error of a ConfirmTx or HoldTx given another
// transaction type.
func (s *SQLStore[TTx]) txType() string { return reflect.TypeFor[TTx]().String() }

// txStore is the middleware's store of st as a *SQLStore[TTx], or an error
// naming what it is, for doing what.
func txStore[TTx any](st *held, doing string) (*SQLStore[TTx], error) {
	if s, ok := st.store.(*SQLStore[TTx]); ok {
		return s, nil
	}
	want := reflect.TypeFor[TTx]().String()
	if sb, ok := st.store.(sqlBacked); ok {
		return nil, fmt.Errorf("dedupe: %s a transaction of type %s needs the middleware's store to be a *dedupe.SQLStore[%s], not a *dedupe.SQLStore[%s] (the store and the transaction must come from the same sqldb.Driver)", doing, want, want, sb.txType())
	}
	return nil, fmt.Errorf("dedupe: %s a transaction of type %s needs the middleware's store to be a *dedupe.SQLStore[%s], not %T", doing, want, want, st.store)
}

// ErrNoClaim is returned by ConfirmTx when the context carries no claim of
// the dedupe middleware.
var ErrNoClaim = errors.New("dedupe: no claim in the context (is the handler behind the dedupe middleware?)")

// ConfirmTx confirms the claim of the message being handled inside tx, the
// handler's own transaction, so that the confirmation commits or rolls back
// with the handler's writes. Call it from a handler behind the dedupe
// middleware, as the last statement before Commit, with msg.Context():
//
//	if err := dedupe.ConfirmTx(ctx, tx); err != nil { return err }
//	return tx.Commit() // tx.Commit(ctx) on pgx
//
// It stops the claim's renewal first (the confirmation locks the row until
// commit). If the handler then returns nil, the middleware takes the
// commit as the confirmation; if it returns an error, the middleware releases
// the claim, which works because the rolled-back confirmation never happened.
//
// The claim itself was taken outside the transaction, so the attempt count
// is durable even when the transaction rolls back or the process dies; the
// store must be the *SQLStore[TTx] of the driver tx comes from, on the
// same database: TTx is *sql.Tx with [sqldb.Std], pgx.Tx with [sqldb.Pgx].
func ConfirmTx[TTx any](ctx context.Context, tx TTx) error {
	st, ok := ctx.Value(heldCtxKey{}).(*held)
	if !ok {
		return ErrNoClaim
	}
	pool, err := txStore[TTx](st, "confirming in")
	if err != nil {
		return err
	}
	s := pool.WithTx(tx)
	ctx, cancel := st.bounded(ctx)
	defer cancel()
	// A renewal in flight is let finish rather than cancelled: cancelled,
	// its UPDATE may still commit on the server after the confirmation's
	// snapshot (REPEATABLE READ), which would refuse the confirmation.
	st.ren.pause(ctx)
	st.stopRenew()
	if err := s.Confirm(ctx, st.claim); err != nil {
		if st.guessedRC && sqlkit.Conflict(err) {
			// The transaction read a snapshot after all, and the renewal
			// beside it may be what it conflicts with (holdPostgres).
			pool.server.defaultLevel.Store(levelUnknown)
			return fmt.Errorf("dedupe: confirm in transaction: %w: %w", sqlkit.ErrGuessedLevel, err)
		}
		if errors.Is(err, ErrClaimLost) && pool.holds(ctx, st.claim) {
			// The claim is not lost: tx cannot see it.
			return errors.New("dedupe: confirm in transaction: the transaction does not see the claim, which the store still holds: tx must be a transaction of the store's database (and table), begun after the claim was taken")
		}
		return fmt.Errorf("dedupe: confirm in transaction: %w", err)
	}
	st.confirmedInTx = true
	return nil
}

// HoldTx hands the protection of the claim of the message being handled to
// tx, the handler's own transaction. Call it from a handler behind the dedupe
// middleware, with msg.Context(), right after beginning tx and before any
// other statement in it; every pipeline transactional handler does. The
// middleware's store must be the *SQLStore[TTx] of the driver tx comes from:
// with a store that is not a SQLStore (a MemoryStore) HoldTx does nothing,
// and with the SQLStore of another transaction type it returns an error
// naming both types.
//
// On SQLite a transaction that writes holds the database's only write lock
// until it ends, so the middleware's renewal, which runs on another
// connection, cannot land, and a handler running longer than the claim
// timeout would be cancelled as if its claim were lost. HoldTx renews the
// claim inside tx instead, taking the write lock at once, and stops the
// background renewal: while tx is open no other writer, and so no other
// worker's takeover, can touch the key, however long the handler runs.
//
// On PostgreSQL at REPEATABLE READ or SERIALIZABLE a renewal landing beside
// the transaction after its snapshot would make the confirmation in it fail
// for good (a serialization failure, for a claim that was never lost). There
// HoldTx renews the claim inside tx, which locks its row until tx ends, and
// stops the background renewal: another worker's takeover, or a claim of the
// same key, waits for tx to end (up to its own deadline, after which its
// delivery is deferred), and then finds the key confirmed or, after a
// rollback, as it was. That is why it must come before any other statement:
// the renewal is stopped before the snapshot is taken. A claim taken over
// already is reported as lost (ErrClaimLost). At READ COMMITTED, and on
// MySQL/MariaDB at every level (InnoDB's UPDATE reads the latest row, not
// the snapshot), the renewal lands beside the transaction and HoldTx
// changes nothing. On PostgreSQL it asks the level (a SHOW that takes no
// snapshot and no lock), except in a pipeline handler's transaction, which
// tells it the level its TxOptions set, or lets it go by the level that its
// last transaction's confirmation read: this one's confirmation checks
// it, and the pipeline runs the transaction again, the level asked, when
// it was wrong.
func HoldTx[TTx any](ctx context.Context, tx TTx) error {
	return holdIn(ctx, tx)
}

// publish sends the handler's output while the claim is still held, so that
// a failure releases the key and the redelivery runs the handler again.
//
// The handler has returned: the context it gave a message (m.SetContext)
// may be cancelled by now, typically one it derived and whose cancel it
// deferred. Each message is published under context.WithoutCancel of its
// own context, which keeps its values (its trace context) and nothing the
// handler can cancel, and then gets its context back. Like the confirmation
// that follows it, the publish is not cut short by the router's shutdown:
// the handler's effects are done, and a publish abandoned now would have
// the redelivery do them again.
func (m *mw) publish(msg *message.Message, out []*message.Message) error {
	topic := message.PublishTopicFromCtx(msg.Context())
	if topic == "" {
		return errors.New("dedupe: handler returned messages but the message context names no publish topic (is the handler added with AddHandler?)")
	}
	own := make([]context.Context, len(out))
	for i, o := range out {
		if o != nil {
			own[i] = o.Context()
			o.SetContext(context.WithoutCancel(own[i]))
		}
	}
	err := m.cfg.Publisher.Publish(topic, out...)
	for i, o := range out {
		if o != nil {
			o.SetContext(own[i])
		}
	}
	if err != nil {
		return fmt.Errorf("dedupe: publishing %d produced messages to %q: %w", len(out), topic, err)
	}
	return nil
}

// confirmRetryMax caps the pause between tries of a confirmation that the
// store could not take.
const confirmRetryMax = time.Second

// confirm records the claim of a handler that succeeded. A store that cannot
// answer (database down, table renamed) is asked again, after pauses that
// grow from 10ms to a second, for as long as it takes: the handler's effects
// are done, and a delivery nacked now would come back once the claim had
// expired and run the handler again. The delivery is held meanwhile, so no
// other consumer gets it. It gives up, returning the error, only when the
// claim is no longer this delivery's (ErrClaimLost) or the delivery's
// context ends (the router is closing).
func (m *mw) confirm(orig context.Context, uuid string, claim Claim) error {
	pause := 10 * time.Millisecond
	for try := 1; ; try++ {
		err := m.settle(orig, claim, true)
		if err == nil {
			if try > 1 {
				m.cfg.Logger.Info("dedupe: confirmed after the store came back", watermill.LogFields{"message_uuid": uuid, "tries": try})
			}
			return nil
		}
		if errors.Is(err, ErrClaimLost) || orig.Err() != nil {
			return err
		}
		if try == 1 {
			m.cfg.Logger.Error("dedupe: confirm failed after the handler succeeded; holding the delivery and trying again until the store answers", err, watermill.LogFields{"message_uuid": uuid})
		}
		if !settlement.Sleep(orig, pause) {
			return err
		}
		pause = min(2*pause, confirmRetryMax)
	}
}

// settle confirms or releases the claim, even if ctx was cancelled.
func (m *mw) settle(ctx context.Context, claim Claim, ok bool) error {
	if !m.local {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), m.cfg.SettleTimeout)
		defer cancel()
	} else if ctx.Err() != nil {
		ctx = context.WithoutCancel(ctx)
	}
	if ok {
		if err := m.cfg.Store.Confirm(ctx, claim); err != nil {
			return fmt.Errorf("dedupe: confirm after successful handler: %w", err)
		}
		return nil
	}
	if err := m.cfg.Store.Release(ctx, claim); err != nil {
		return fmt.Errorf("dedupe: release after failed handler: %w", err)
	}
	return nil
}

// renew keeps the claim alive, with r (the holder's renewal), until r.stop
// is called; r.stop of a renewal never started does nothing. stop waits for
// a renewal in flight to finish and may be called twice.
//
// It runs on the middleware's renewal schedule rather than a goroutine or a
// timer of its own: most handlers finish before the first renewal is due,
// and then renewal costs two list operations.
func (m *mw) renew(ctx *handlerCtx, r *renewal, uuid string, claim Claim) {
	r.m, r.ctx, r.uuid, r.claim, r.expires = m, ctx, uuid, claim, claim.ExpiresAt
	if r.expires.IsZero() {
		r.expires = time.Now().Add(m.cfg.ClaimTimeout)
	}
	m.schedule.add(r)
}

// schedule holds the renewals of one middleware's running handlers in the
// order they are due (each is due RenewInterval after it was added, so the
// list is kept in order by adding at its end), on one timer armed for the
// first. The timer is not disarmed when a renewal leaves the list: when it
// fires early it finds nothing due and is armed again for the new first.
type schedule struct {
	interval time.Duration

	mu         sync.Mutex
	head, tail *renewal
	timer      *time.Timer // made on first use
	armed      bool
}

// add makes r due one interval from now.
func (s *schedule) add(r *renewal) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	r.due, r.queued = now.Add(s.interval), true
	r.prev, r.next = s.tail, nil
	if s.tail != nil {
		s.tail.next = r
	} else {
		s.head = r
	}
	s.tail = r
	switch {
	case s.timer == nil:
		s.timer = time.AfterFunc(s.interval, s.fire)
		s.armed = true
	case !s.armed:
		s.timer.Reset(s.interval)
		s.armed = true
	}
}

// remove takes r off the list, if it is there.
func (s *schedule) remove(r *renewal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unlink(r)
}

func (s *schedule) unlink(r *renewal) {
	if !r.queued {
		return
	}
	if r.prev != nil {
		r.prev.next = r.next
	} else {
		s.head = r.next
	}
	if r.next != nil {
		r.next.prev = r.prev
	} else {
		s.tail = r.prev
	}
	r.prev, r.next, r.queued = nil, nil, false
}

// fire starts the renewals that are due, each on a goroutine of its own (a
// store call may be slow), and arms the timer for the next.
func (s *schedule) fire() {
	var due []*renewal
	now := time.Now()
	s.mu.Lock()
	for s.head != nil && !s.head.due.After(now) {
		r := s.head
		s.unlink(r)
		due = append(due, r)
	}
	s.armed = s.head != nil
	if s.armed {
		s.timer.Reset(s.head.due.Sub(now))
	}
	s.mu.Unlock()
	for _, r := range due {
		go r.fire()
	}
}

type renewal struct {
	m     *mw
	ctx   *handlerCtx // the handler's, cancelled (lose) when the claim is lost
	uuid  string
	claim Claim

	// On the middleware's schedule, guarded by its lock.
	prev, next *renewal
	due        time.Time
	queued     bool

	mu       sync.Mutex
	stopped  bool
	paused   bool               // by pause, until resume: a renewal due is missed, not run
	missed   bool               // a renewal came due while paused
	rcancel  context.CancelFunc // cancels a renewal in flight
	done     chan struct{}      // closed when the last renewal started has finished; nil before the first
	inflight sync.WaitGroup
	// expires is when the claim lapses in the store unless a renewal lands:
	// once renewals have failed past it, another worker may have taken the
	// key over, so the handler is cancelled rather than left running without
	// a claim. Only fire touches it.
	expires time.Time
}

func (r *renewal) fire() {
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	if r.paused {
		r.missed = true // resume starts it
		r.mu.Unlock()
		return
	}
	rctx, rcancel := context.WithCancel(r.ctx)
	r.rcancel = rcancel
	done := make(chan struct{})
	r.done = done
	r.inflight.Add(1)
	r.mu.Unlock()
	defer r.inflight.Done()
	defer close(done)
	defer rcancel()

	again := r.once(rctx)
	r.mu.Lock()
	if again && !r.stopped {
		r.m.schedule.add(r)
	}
	r.mu.Unlock()
}

// once renews the claim once and reports whether to keep renewing.
func (r *renewal) once(rctx context.Context) bool {
	m := r.m
	start := time.Now()
	// A renewal that cannot land before the claim lapses is useless, and
	// one the store does not answer within StoreTimeout is tried again.
	deadline := r.expires
	if d := m.storeTimeout(); d > 0 && start.Add(d).Before(deadline) {
		deadline = start.Add(d)
	}
	cctx, ccancel := context.WithDeadline(rctx, deadline)
	err := m.cfg.Store.Renew(cctx, r.claim, m.cfg.ClaimTimeout)
	ccancel()
	switch {
	case err == nil:
		r.expires = start.Add(m.cfg.ClaimTimeout)
		return true
	case rctx.Err() != nil:
		return false
	case errors.Is(err, ErrClaimLost):
		m.cfg.Logger.Error("dedupe: claim lost while the handler ran; cancelling it", err, watermill.LogFields{"message_uuid": r.uuid})
		r.ctx.lose(ErrClaimLost)
		return false
	case !time.Now().Before(r.expires):
		m.cfg.Logger.Error("dedupe: claim expired while renewals failed; cancelling the handler", err, watermill.LogFields{"message_uuid": r.uuid})
		r.ctx.lose(&unrenewed{err: err})
		return false
	default:
		m.cfg.Logger.Error("dedupe: renewing claim failed; will retry", err, watermill.LogFields{"message_uuid": r.uuid})
		return true
	}
}

// unrenewed is the cause of a claim lost because renewals failed until it
// expired: the store did not answer, which is no fault of the delivery.
type unrenewed struct{ err error }

func (e *unrenewed) Error() string {
	return ErrClaimLost.Error() + ": it expired while renewals failed: " + e.err.Error()
}

func (e *unrenewed) Unwrap() []error { return []error{ErrClaimLost, e.err} }

// renewalsFailed reports whether the handler's context was cancelled
// because its claim expired while renewals failed.
func renewalsFailed(hctx *handlerCtx) bool {
	if !hctx.made.Load() {
		return false
	}
	var u *unrenewed
	return errors.As(context.Cause(hctx.inner), &u)
}

// pause keeps the claim from being renewed until resume (or stop), and
// waits for a renewal in flight to finish: let finish, not cancelled, so
// that its statement has ended on the server when pause returns (a
// cancelled statement may still commit there later). If ctx ends first, the
// renewal in flight is cancelled and waited for. A renewal that comes due
// while paused runs at resume.
func (r *renewal) pause(ctx context.Context) {
	r.mu.Lock()
	r.paused = true
	done, cancel := r.done, r.rcancel
	r.mu.Unlock()
	if done == nil {
		return
	}
	select {
	case <-done:
	case <-ctx.Done():
		cancel()
		<-done
	}
}

// resume undoes pause, and renews at once if a renewal came due meanwhile.
func (r *renewal) resume() {
	r.mu.Lock()
	missed := r.missed && !r.stopped
	r.paused, r.missed = false, false
	r.mu.Unlock()
	if missed {
		go r.fire()
	}
}

func (r *renewal) stop() {
	r.mu.Lock()
	if !r.stopped {
		r.stopped = true
		if r.m != nil { // nil: never started
			r.m.schedule.remove(r)
		}
		if r.rcancel != nil {
			r.rcancel()
		}
	}
	r.mu.Unlock()
	r.inflight.Wait()
}
