package middleware

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/poison"
)

// RetryConfig configures the bounded retry middleware.
//
// An attempt is one run of the handler. A delivery gets up to
// 1+InProcessRetries attempts, with exponential backoff and jitter between
// them; then the message is nacked after a delay so that the broker redelivers
// it; once MaxAttempts attempts in total have failed, the middleware returns
// an *ExhaustedError, which the dead-letter middleware parks.
type RetryConfig struct {
	// MaxAttempts is the number of handler runs, across all deliveries and
	// processes, after which the message is dead-lettered. Defaults to 5.
	// Must be >= 1.
	MaxAttempts int
	// InProcessRetries is how many times a failed run is retried within the
	// same delivery before the message is handed back to the broker.
	// Defaults to 2; set NoInProcessRetries for none. Must be >= 0.
	InProcessRetries int
	// NoInProcessRetries makes every failure go back to the broker at once
	// (after RedeliveryDelay).
	NoInProcessRetries bool
	// InitialInterval is the backoff before the first in-process retry.
	// Defaults to 100ms. Must be > 0.
	InitialInterval time.Duration
	// MaxInterval caps the backoff. Defaults to 10s. Must be >= InitialInterval.
	MaxInterval time.Duration
	// Multiplier grows the backoff per attempt. Defaults to 2. Must be >= 1.
	Multiplier float64
	// RandomizationFactor spreads each backoff over [1-f, 1+f] times its
	// value, so that failing consumers do not retry in lockstep. Defaults to
	// 0.5. Must be in [0, 1].
	RandomizationFactor float64
	// RedeliveryDelay is the least time a failed message is held before it
	// is nacked for redelivery; the backoff of the attempt is used when it is
	// longer. It keeps a broker that requeues at once (RabbitMQ, GoChannel)
	// from turning a failing message into a hot loop. Defaults to 1s. Must
	// be >= 0.
	RedeliveryDelay time.Duration
	// DeferDelay is how long a deferred message (its dedupe key held by
	// another worker's live claim) is held before it is nacked. It is not an
	// attempt. Defaults to 1s. Must be >= 0.
	DeferDelay time.Duration
	// Republish, when set, hands a failed message back by publishing a copy
	// (same UUID, metadata settle_attempt and failure times) to the topic it
	// came from and acking the original, instead of nacking. Use it where
	// neither a dedupe store nor the broker counts deliveries. If the
	// publish fails the original is nacked.
	Republish message.Publisher
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// TrackedMessages bounds the per-process memory of failures kept for
	// messages whose attempts no durable source counts. Defaults to 10000.
	TrackedMessages int
}

func (c *RetryConfig) setDefaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.InProcessRetries == 0 && !c.NoInProcessRetries {
		c.InProcessRetries = 2
	}
	if c.InitialInterval == 0 {
		c.InitialInterval = 100 * time.Millisecond
	}
	if c.MaxInterval == 0 {
		c.MaxInterval = 10 * time.Second
	}
	if c.Multiplier == 0 {
		c.Multiplier = 2
	}
	if c.RandomizationFactor == 0 {
		c.RandomizationFactor = 0.5
	}
	if c.RedeliveryDelay == 0 {
		c.RedeliveryDelay = time.Second
	}
	if c.DeferDelay == 0 {
		c.DeferDelay = time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.TrackedMessages == 0 {
		c.TrackedMessages = 10000
	}
}

// Validate reports the first invalid field.
func (c RetryConfig) Validate() error {
	switch {
	case c.MaxAttempts < 1:
		return fmt.Errorf("middleware: RetryConfig.MaxAttempts must be >= 1, got %d", c.MaxAttempts)
	case c.InProcessRetries < 0:
		return fmt.Errorf("middleware: RetryConfig.InProcessRetries must be >= 0, got %d", c.InProcessRetries)
	case c.NoInProcessRetries && c.InProcessRetries != 0:
		return errors.New("middleware: RetryConfig.NoInProcessRetries is set together with InProcessRetries")
	case c.InitialInterval <= 0:
		return fmt.Errorf("middleware: RetryConfig.InitialInterval must be > 0, got %v", c.InitialInterval)
	case c.MaxInterval < c.InitialInterval:
		return fmt.Errorf("middleware: RetryConfig.MaxInterval must be >= InitialInterval, got %v", c.MaxInterval)
	case c.Multiplier < 1:
		return fmt.Errorf("middleware: RetryConfig.Multiplier must be >= 1, got %v", c.Multiplier)
	case c.RandomizationFactor < 0 || c.RandomizationFactor > 1:
		return fmt.Errorf("middleware: RetryConfig.RandomizationFactor must be in [0, 1], got %v", c.RandomizationFactor)
	case c.RedeliveryDelay < 0:
		return fmt.Errorf("middleware: RetryConfig.RedeliveryDelay must be >= 0, got %v", c.RedeliveryDelay)
	case c.DeferDelay < 0:
		return fmt.Errorf("middleware: RetryConfig.DeferDelay must be >= 0, got %v", c.DeferDelay)
	case c.TrackedMessages < 1:
		return fmt.Errorf("middleware: RetryConfig.TrackedMessages must be >= 1, got %d", c.TrackedMessages)
	}
	return nil
}

// ExhaustedError is returned by the retry middleware when a message has used
// all its attempts. The dead-letter middleware parks it.
type ExhaustedError struct {
	// Err is the last failure. It may be a *dedupe.ExhaustedError when the
	// handler was not started again because earlier attempts never finished
	// (the consumer crashed during each of them).
	Err          error
	Attempts     int
	FirstFailure time.Time
	LastFailure  time.Time
}

func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("attempts exhausted after %d: %v", e.Attempts, e.Err)
}

// Unwrap returns the last failure.
func (e *ExhaustedError) Unwrap() error { return e.Err }

// PanicError is a recovered panic of the handler. It is retried like any
// other failure.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

// NewRetry returns the bounded retry middleware.
//
// Attempts are counted, best source first: the dedupe claim's durable count
// when the dedupe middleware runs inside this one (exact, across crashes);
// settle_attempt metadata on a copy this middleware republished; the broker's
// delivery count (settle_delivery_count, set by settle's AMQP marshaler from
// quorum queues' x-delivery-count), assuming each earlier delivery used all its
// in-process retries, so it may dead-letter early after crashes but never
// runs more than MaxAttempts times; otherwise a per-process count that a
// restart forgets.
//
// Permanent errors (see package poison) are returned at once, not retried.
// A panic in the handler is recovered and treated as a failure.
func NewRetry(cfg RetryConfig) (message.HandlerMiddleware, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := &retry{cfg: cfg, tracked: newTracker(cfg.TrackedMessages)}
	return r.wrap, nil
}

type retry struct {
	cfg     RetryConfig
	tracked *tracker
}

func (r *retry) newBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = r.cfg.InitialInterval
	b.MaxInterval = r.cfg.MaxInterval
	b.Multiplier = r.cfg.Multiplier
	b.RandomizationFactor = r.cfg.RandomizationFactor
	b.Reset()
	return b
}

func (r *retry) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		msg.SetContext(dedupe.WithAttemptLimit(ctx, r.cfg.MaxAttempts))
		defer msg.SetContext(ctx)

		src := r.source(msg)
		if src.prior >= r.cfg.MaxAttempts {
			return nil, r.usedUp(msg, src.prior)
		}
		msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(src.prior+1))
		out, err := runRecovered(h, msg)
		if err == nil {
			r.tracked.forget(msg.UUID)
			return out, nil
		}
		return r.failed(ctx, h, msg, src, err)
	}
}

// usedUp dead-letters a message whose count says the attempts are used up,
// yet is here again: the last attempts died with their consumer, or the
// dead-letter publish failed. The last failure, when this process saw it,
// stays the reason on the dead-letter copy.
func (r *retry) usedUp(msg *message.Message, prior int) error {
	cause := r.tracked.lastErr(msg.UUID)
	if cause == nil {
		cause = fmt.Errorf("no attempt left: %d made", prior)
	}
	return r.exhausted(msg, prior, cause)
}

// failed handles a failed run of h: defers, dead-letters, hands the message
// back to the broker, or retries it in process until a run succeeds or the
// in-process retries are used up. It is apart from the middleware's closure
// so that the closure's stack frame, on every message's path, stays small.
func (r *retry) failed(ctx context.Context, h message.HandlerFunc, msg *message.Message, src attemptSource, err error) ([]*message.Message, error) {
	var bo *backoff.ExponentialBackOff // made on the first failure only
	for run := 1; ; run++ {
		attempt := src.prior + 1
		if !src.perDelivery {
			attempt = src.prior + run
		}
		if run > 1 {
			msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(attempt))
			var out []*message.Message
			if out, err = runRecovered(h, msg); err == nil {
				r.tracked.forget(msg.UUID)
				return out, nil
			}
		}
		var dx *dedupe.ExhaustedError
		switch {
		case errors.As(err, &dx):
			return nil, r.exhausted(msg, dx.Attempt-1, err)
		case errors.Is(err, dedupe.ErrBusy):
			// Deferred: another worker has it. Not an attempt.
			park.Sleep(ctx, r.cfg.DeferDelay)
			return nil, err
		case poison.IsPermanent(err):
			r.tracked.forget(msg.UUID)
			return nil, err
		}
		r.tracked.failed(msg.UUID, src.firstHint, err)
		if c, ok := dedupe.ClaimFromContext(msg.Context()); ok && c.Result == dedupe.Acquired {
			attempt = c.Attempt // the durable count, exact across processes
			msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(attempt))
		}
		trace.SpanFromContext(ctx).AddEvent("settle.attempt_failed", trace.WithAttributes(
			attribute.Int("settle.attempt", attempt), attribute.String("exception.message", err.Error())))
		if attempt >= r.cfg.MaxAttempts {
			return nil, r.exhausted(msg, attempt, err)
		}
		if bo == nil {
			bo = r.newBackoff()
		}
		wait := bo.NextBackOff()
		if run > r.cfg.InProcessRetries {
			return r.handBack(msg, attempt, max(wait, r.cfg.RedeliveryDelay), err)
		}
		settle.SettlementFromContext(ctx).Retried()
		r.cfg.Logger.Debug("retry: handler failed; retrying in process", watermill.LogFields{
			"message_uuid": msg.UUID, "attempt": attempt, "backoff": wait.String(), "err": err.Error(),
		})
		if !park.Sleep(ctx, wait) {
			return nil, errors.Join(err, ctx.Err())
		}
	}
}

// attemptSource is what is known, before a delivery runs, of earlier attempts.
type attemptSource struct {
	prior int // attempts made before this delivery
	// perDelivery: the source counts deliveries, not runs, so in-process
	// retries do not add attempts.
	perDelivery bool
	firstHint   time.Time // first failure recorded on the message, if any
}

func (r *retry) source(msg *message.Message) attemptSource {
	var src attemptSource
	// Parse only what is there: a failed parse allocates its error.
	if v := msg.Metadata.Get(settle.MetaFirstFailure); v != "" {
		if t, err := time.Parse(park.TimeFormat, v); err == nil {
			src.firstHint = t
		}
	}
	if v := msg.Metadata.Get(settle.MetaAttempt); r.cfg.Republish != nil && v != "" {
		if n, err := strconv.Atoi(v); err == nil && n >= 0 {
			src.prior = n
			return src
		}
	}
	if v := msg.Metadata.Get(settle.MetaDeliveryCount); v != "" {
		if n, err := strconv.Atoi(v); err == nil && n >= 1 {
			src.prior, src.perDelivery = n-1, true
			return src
		}
	}
	src.prior = r.tracked.runs(msg.UUID)
	return src
}

// exhausted builds the error the dead-letter middleware parks. The failure
// record is kept: if the dead-letter publish fails and the message comes back,
// the per-process count must still say that no attempt is left.
func (r *retry) exhausted(msg *message.Message, attempts int, err error) error {
	first, last := r.tracked.times(msg.UUID)
	now := time.Now()
	if first.IsZero() {
		first = r.source(msg).firstHint
	}
	if first.IsZero() {
		first = now
	}
	if last.IsZero() {
		last = now
	}
	if first.After(last) {
		first = last // a first-failure time from the future is not believed
	}
	msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(attempts))
	return &ExhaustedError{Err: err, Attempts: attempts, FirstFailure: first, LastFailure: last}
}

// handBack returns the message to the broker after wait: by nack, or by
// republishing a copy and acking.
func (r *retry) handBack(msg *message.Message, attempt int, wait time.Duration, err error) ([]*message.Message, error) {
	ctx := msg.Context()
	r.cfg.Logger.Debug("retry: handing the message back for redelivery", watermill.LogFields{
		"message_uuid": msg.UUID, "attempt": attempt, "delay": wait.String(), "err": err.Error(),
	})
	if !park.Sleep(ctx, wait) {
		return nil, errors.Join(err, ctx.Err())
	}
	settle.SettlementFromContext(ctx).SetOutcome(settle.Retry)
	if r.cfg.Republish == nil {
		return nil, err
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	if topic == "" {
		return nil, errors.Join(err, errors.New("retry: cannot republish: no subscribe topic in the message context"))
	}
	first, last := r.tracked.times(msg.UUID)
	cp := park.Copy(msg, park.Info{Outcome: settle.Retry, Reason: err.Error(), Attempt: attempt, FirstFailure: first, LastFailure: last})
	if perr := r.cfg.Republish.Publish(topic, cp); perr != nil {
		return nil, errors.Join(err, fmt.Errorf("retry: republish to %q: %w", topic, perr))
	}
	r.tracked.forget(msg.UUID)
	return nil, nil
}

func runRecovered(h message.HandlerFunc, msg *message.Message) (out []*message.Message, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return h(msg)
}

// tracker remembers failures per message UUID in this process: the times of
// the first and last failure, and the number of failed runs for messages
// whose attempts no durable source counts. It holds at most max messages,
// dropping the least recently failed.
type tracker struct {
	mu   sync.Mutex
	max  int
	byID map[string]*record
	size atomic.Int64 // len(byID), read without the lock
}

type record struct {
	runs        int
	first, last time.Time
	lastErr     error
}

func newTracker(max int) *tracker { return &tracker{max: max, byID: map[string]*record{}} }

func (t *tracker) failed(id string, firstHint time.Time, err error) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	r, ok := t.byID[id]
	if !ok {
		if len(t.byID) >= t.max {
			t.evict()
		}
		r = &record{first: now}
		if !firstHint.IsZero() && firstHint.Before(now) {
			r.first = firstHint
		}
		t.byID[id] = r
		t.size.Store(int64(len(t.byID)))
	}
	r.runs++
	r.last = now
	r.lastErr = err
}

// lastErr returns the last failure recorded for id, or nil.
func (t *tracker) lastErr(id string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r, ok := t.byID[id]; ok {
		return r.lastErr
	}
	return nil
}

// evict drops the tenth of the records that failed longest ago. The caller
// holds t.mu.
func (t *tracker) evict() {
	n := max(1, t.max/10)
	for range n {
		var oldest string
		var at time.Time
		for id, r := range t.byID {
			if oldest == "" || r.last.Before(at) {
				oldest, at = id, r.last
			}
		}
		delete(t.byID, oldest)
	}
}

func (t *tracker) runs(id string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r, ok := t.byID[id]; ok {
		return r.runs
	}
	return 0
}

func (t *tracker) times(id string) (first, last time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r, ok := t.byID[id]; ok {
		return r.first, r.last
	}
	return time.Time{}, time.Time{}
}

func (t *tracker) forget(id string) {
	if t.size.Load() == 0 {
		return // nothing has failed: the common case costs no lock
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.byID, id)
	t.size.Store(int64(len(t.byID)))
}
