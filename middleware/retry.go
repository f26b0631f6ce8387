package middleware

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/deliverymark"
	"github.com/settle-go/settle/internal/lru"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/telemetry"
)

// NoJitter, as RetryConfig.RandomizationFactor, makes every backoff exactly
// its computed value.
const NoJitter = -1.0

// RetryConfig configures the bounded retry middleware.
//
// An attempt is one run of the handler on the message. A delivery gets up to
// 1+InProcessRetries runs, with exponential backoff and jitter between them;
// then the message is nacked after a delay so that the broker redelivers it;
// once MaxAttempts runs have failed in all, the middleware returns an
// *ExhaustedError, which the dead-letter parking middleware parks. A delivery
// that is deferred (its key busy, the dedupe store unavailable, a parked
// copy not published) is not an attempt.
type RetryConfig struct {
	// MaxAttempts bounds the runs of one handler on one message, whatever
	// counts them (see NewRetry); when they have all failed the message is
	// dead-lettered. Defaults to 5. Must be >= 1.
	MaxAttempts int
	// InProcessRetries is how many times a failed run is retried within the
	// same delivery before the message is handed back to the broker.
	// Defaults to 2; set NoInProcessRetries for none. Must be >= 0.
	InProcessRetries int
	// NoInProcessRetries makes every failure go back to the broker at once
	// (after RedeliveryDelay).
	NoInProcessRetries bool
	// InitialInterval is the backoff before the first in-process retry.
	// Defaults to 100ms when zero; settle.NoDelay for none. Must be >= 0 or
	// settle.NoDelay.
	InitialInterval time.Duration
	// MaxInterval caps the backoff. Defaults to 10s. Must be >=
	// InitialInterval.
	MaxInterval time.Duration
	// Multiplier grows the backoff per attempt. Defaults to 2. Must be >= 1.
	Multiplier float64
	// RandomizationFactor spreads each backoff over [1-f, 1+f] times its
	// value, so that failing consumers do not retry in lockstep. Defaults to
	// 0.5 when zero; NoJitter for none. Must be in [0, 1] or NoJitter.
	RandomizationFactor float64
	// RedeliveryDelay is the least time a failed message is held before it
	// is nacked for redelivery; the backoff of the attempt is used when it is
	// longer. It keeps a broker that requeues at once (RabbitMQ, GoChannel)
	// from turning a failing message into a hot loop. A delivery whose
	// broker holds a nack itself before redelivering (NATS JetStream through
	// a subscriber configured by package natsjs, which marks each delivery
	// with that delay) is nacked that much sooner: at once when the broker's
	// delay covers the wait, so the delivery does not keep a goroutine and a
	// router slot. Defaults to 1s when zero; settle.NoDelay for none. Must be
	// >= 0 or settle.NoDelay.
	RedeliveryDelay time.Duration
	// Republish, when set, hands a failed message back by publishing a copy
	// (same UUID, metadata settle_attempt and failure times) to the topic it
	// came from and acking the original, instead of nacking. Use it where
	// neither a dedupe store nor the broker counts deliveries. If the
	// publish fails the original is nacked. Requires RepublishKey.
	Republish message.Publisher
	// RepublishKey signs the attempt count of every copy Republish
	// publishes (MetaAttemptMark: an HMAC-SHA256 of the topic, the UUID and
	// the count). A settle_attempt is believed only on a copy whose mark
	// this key verifies; on any other message (a producer's, or a copy
	// marked with another key) it is ignored, so a producer cannot make a
	// message dead-letter without a run. Every process consuming the topic
	// must use the same key, kept secret like a password. Required with
	// Republish, at least 16 bytes; unused without it.
	RepublishKey []byte
	// StoreCounts says that the dedupe middleware runs inside this one
	// (retry -> dedupe -> handler), so that its store counts the runs: the
	// key's durable acquisition count is the attempt number, and the store
	// refuses a run beyond MaxAttempts. From the first delivery on, the
	// retry middleware then leaves the decision to start a run to the store,
	// and uses none of its own sources (a republished copy's settle_attempt,
	// the broker's delivery count, this process's memory) for it. pipeline
	// sets it for every handler it puts the dedupe middleware in front of;
	// set it on a router assembled by hand in the same case, and only then.
	//
	// Set without a dedupe middleware inside (or with one outside this
	// middleware), a failed run that no store counted is logged as an
	// error and counted from this process's memory, as without StoreCounts:
	// the bound still holds, but the broker's delivery count is not used.
	// Left unset with a dedupe middleware inside, both count: the dedupe
	// middleware logs an error once, and a delivery whose delivery count
	// alone says its runs are used up is dead-lettered without a run,
	// whatever the store's count.
	StoreCounts bool
	// StoreInside says that, although no store counts the runs
	// (StoreCounts unset), a store inside this middleware knows whether the
	// message's key is confirmed: a transactional handler that writes its
	// keys in its own transaction (pipeline.TxConfig.OneStatement or Batch),
	// or a dedupe middleware whose count is not used. Then a delivery whose
	// count (the broker's delivery count, say) leaves no attempt is still
	// handed in, marked as having none, for the store's answer: a duplicate,
	// acked, when an earlier delivery confirmed the key (its work is done,
	// its ack was lost); otherwise a refusal, and the message is
	// dead-lettered, the handler's function not run. The store commits the
	// refusal before it answers (dedupe.SQLStore.Refuse), so that another
	// delivery of the message still in flight (a consumer that froze with
	// it while the broker redelivered it) is refused too when it claims the
	// key, whatever attempts it has left, and the refusal reaches this
	// middleware from that delivery's run as any refusal does: the message
	// is never both done and dead-lettered. Without it such a
	// delivery is dead-lettered at once, done or not. pipeline sets it for
	// OneStatement and Batch handlers; set it on a router assembled by hand
	// in the same case, and only then: a handler without such a store would
	// run once more (logged as an error, the run then counted as the
	// last).
	StoreInside bool
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// TrackedMessages bounds the per-process memory of failing messages: the
	// times of their first and last failure, and their run count where no
	// durable source counts attempts. The least recently failed is dropped
	// first; every operation on it is O(1). Defaults to 10000. Must be >= 1.
	TrackedMessages int
}

func (c *RetryConfig) setDefaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.InProcessRetries == 0 && !c.NoInProcessRetries {
		c.InProcessRetries = 2
	}
	c.InitialInterval = settlement.Delay(c.InitialInterval, 100*time.Millisecond)
	if c.MaxInterval == 0 {
		c.MaxInterval = max(10*time.Second, c.InitialInterval)
	}
	if c.Multiplier == 0 {
		c.Multiplier = 2
	}
	switch c.RandomizationFactor {
	case 0:
		c.RandomizationFactor = 0.5
	case NoJitter:
		c.RandomizationFactor = 0
	}
	c.RedeliveryDelay = settlement.Delay(c.RedeliveryDelay, time.Second)
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.TrackedMessages == 0 {
		c.TrackedMessages = 10000
	}
}

// validate reports the first invalid field.
func (c RetryConfig) validate() error {
	switch {
	case c.MaxAttempts < 1:
		return fmt.Errorf("middleware: RetryConfig.MaxAttempts must be >= 1, got %d", c.MaxAttempts)
	case c.InProcessRetries < 0:
		return fmt.Errorf("middleware: RetryConfig.InProcessRetries must be >= 0, got %d", c.InProcessRetries)
	case c.NoInProcessRetries && c.InProcessRetries != 0:
		return errors.New("middleware: RetryConfig.NoInProcessRetries is set together with InProcessRetries")
	case c.InitialInterval < 0:
		return fmt.Errorf("middleware: RetryConfig.InitialInterval must be >= 0 or settle.NoDelay, got %v", c.InitialInterval)
	case c.MaxInterval < c.InitialInterval:
		return fmt.Errorf("middleware: RetryConfig.MaxInterval must be >= InitialInterval, got %v", c.MaxInterval)
	case c.Multiplier < 1:
		return fmt.Errorf("middleware: RetryConfig.Multiplier must be >= 1, got %v", c.Multiplier)
	case c.RandomizationFactor < 0 || c.RandomizationFactor > 1:
		return fmt.Errorf("middleware: RetryConfig.RandomizationFactor must be in [0, 1] or NoJitter, got %v", c.RandomizationFactor)
	case c.RedeliveryDelay < 0:
		return fmt.Errorf("middleware: RetryConfig.RedeliveryDelay must be >= 0 or settle.NoDelay, got %v", c.RedeliveryDelay)
	case c.Republish != nil && len(c.RepublishKey) < minRepublishKey:
		return fmt.Errorf("middleware: RetryConfig.RepublishKey must be at least %d bytes with Republish (the same secret in every process consuming the topic), got %d", minRepublishKey, len(c.RepublishKey))
	case c.TrackedMessages < 1:
		return fmt.Errorf("middleware: RetryConfig.TrackedMessages must be >= 1, got %d", c.TrackedMessages)
	}
	return nil
}

// minRepublishKey is the shortest RetryConfig.RepublishKey.
const minRepublishKey = 16

// MetaAttemptMark is the metadata key of the mark that the retry middleware
// puts on a copy it republishes (RetryConfig.Republish): base64url of an
// HMAC-SHA256, under RetryConfig.RepublishKey, of the topic, the UUID and
// settle_attempt. The copy's settle_attempt is believed only when the mark
// verifies.
const MetaAttemptMark = park.MetaAttemptMark

// attemptMark returns the mark of attempt on the message uuid republished
// to topic. Each field is length-prefixed, so no two triples share a text.
func attemptMark(key []byte, topic, uuid, attempt string) string {
	m := hmac.New(sha256.New, key)
	for _, f := range [...]string{topic, uuid, attempt} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		m.Write(n[:])
		m.Write([]byte(f))
	}
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// markedAttempt returns the settle_attempt of msg when msg carries settle's
// mark for it under key, for the topic it was consumed from.
func markedAttempt(key []byte, msg *message.Message) (string, bool) {
	v, mark := msg.Metadata.Get(settle.MetaAttempt), msg.Metadata.Get(MetaAttemptMark)
	if v == "" || mark == "" || len(key) == 0 {
		return "", false
	}
	want := attemptMark(key, message.SubscribeTopicFromCtx(msg.Context()), msg.UUID, v)
	return v, hmac.Equal([]byte(mark), []byte(want))
}

// ExhaustedError is returned by the retry middleware when a message has used
// all its attempts. The dead-letter parking middleware parks it.
type ExhaustedError struct {
	// Err is the last failure. When the handler was not started again
	// because earlier attempts never finished (the consumer died during each
	// of them), it is the dedupe store's refusal, wrapping
	// dedupe.ErrAttemptsUsedUp.
	Err      error
	Attempts int
	// FirstFailure is the time of the first failed run, zero when no
	// process that saw it is left to say (earlier attempts died with their
	// consumer); the parked copy then carries no settle_first_failure_at.
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
// MaxAttempts bounds the runs of one handler on one message. Attempts are
// counted per logical handler (the router handler's name; a pipeline
// handler's competing subscriptions name, name#2, ... share one count), so
// two handlers consuming the same message each get MaxAttempts runs. The
// count comes from, best source first:
//
//   - a dedupe store, when the dedupe middleware runs inside this one and
//     StoreCounts says so: the
//     key's durable acquisition count, one per run, exact across processes
//     and crashes; the dedupe middleware refuses to start a run beyond
//     MaxAttempts;
//   - settle_attempt on a copy this middleware republished (Republish),
//     believed only when the copy's MetaAttemptMark verifies under
//     RepublishKey: on any other message it is the producer's word, and
//     ignored;
//   - the broker's delivery count (settle_delivery_count, set by settle's
//     AMQP marshaler from quorum queues' x-delivery-count, and only for a
//     marshaler told the queue is one, amqpmarshal.Config.QuorumQueue,
//     because a classic queue passes on a producer's header; believed only
//     with the mark that marshaler adds in this process, so that a
//     settle_delivery_count another marshaler copied from a producer's
//     header is ignored; by natsjs's subscriber from NATS JetStream's
//     NumDelivered, and by redissub.Subscriber from a Redis Streams pending
//     entry's times-delivered, with the same mark): each earlier
//     delivery is taken to have used all its 1+InProcessRetries runs, so
//     the bound holds even when the consumer died during a delivery, at the
//     price of dead-lettering early after a crash or a deferral;
//   - otherwise this process's memory (TrackedMessages): it bounds the runs
//     made in this process since it started, of messages among the
//     TrackedMessages that failed most recently. A restart forgets it.
//
// Where a dedupe store counts (RetryConfig.StoreCounts), no other source is
// used: the store's count decides from the first delivery on, on a router
// assembled by hand as in a pipeline.
//
// Permanent errors (settle.IsPermanent: see package poison) are returned at
// once, not retried. A panic in the handler is recovered and treated as a
// failure. A deferred delivery is returned at once: it is not an attempt,
// and the middleware that deferred it has already waited.
func NewRetry(cfg RetryConfig) (message.HandlerMiddleware, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &retry{cfg: cfg, tracked: lru.New[trackKey, *failures](cfg.TrackedMessages), misplaced: settlement.NewRateLog(cfg.Logger, time.Minute)}
	return r.wrap, nil
}

type retry struct {
	cfg     RetryConfig
	tracked *lru.Cache[trackKey, *failures]
	// misplaced logs a stack assembled against the contract of
	// RetryConfig.StoreCounts.
	misplaced *settlement.RateLog
}

// errNotCounted is logged when RetryConfig.StoreCounts is set and a failed
// run was counted by no store.
var errNotCounted = errors.New("RetryConfig.StoreCounts is set, but no dedupe middleware inside the retry middleware counted the run")

// errCountedOutside is logged when a store counted the delivery before the
// retry middleware ran: the dedupe middleware is outside it.
// errNotLooked is logged when RetryConfig.StoreInside is set and no store
// inside took the last look at a delivery with no attempt left.
var errNotLooked = errors.New("RetryConfig.StoreInside is set, but no store inside looked up the key of a delivery with no attempt left: the handler ran")

var errCountedOutside = errors.New("the dedupe middleware runs outside the retry middleware: its in-process retries run under one claim, and the store counts deliveries, not runs")

// trackKey names one message in the scope of one logical handler.
type trackKey struct{ scope, uuid string }

// failures is what this process saw of a message's failed runs.
type failures struct {
	runs        int
	first, last time.Time
	lastErr     error
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
		orig := msg.Context()
		ctx, rec, created := settlement.Ensure(orig)
		if created {
			msg.SetContext(ctx)
			defer msg.SetContext(orig)
		}
		if _, counted, _ := rec.Attempt(); counted {
			r.misplaced.Error("retry: the settle stack is misassembled; put the dedupe middleware inside the retry middleware", errCountedOutside,
				watermill.LogFields{"handler": message.HandlerNameFromCtx(ctx)})
		}
		rec.SetLimit(r.cfg.MaxAttempts, r.cfg.StoreCounts)
		d := delivery{key: trackKey{settlement.Scope(ctx), park.Identity(msg)}, rec: rec}
		r.prepare(msg, &d)
		if d.prior >= r.cfg.MaxAttempts {
			if r.cfg.StoreInside {
				return r.lastLook(h, msg, d)
			}
			return nil, r.exhausted(msg, d, r.cfg.MaxAttempts, nil)
		}
		rec.BeginRun()
		r.setAttempt(msg, rec, d.prior+1)
		out, err := runRecovered(h, msg)
		if err == nil && !rec.Deferred() {
			r.tracked.Delete(d.key)
			return out, nil
		}
		return r.failed(ctx, h, msg, d, out, err)
	}
}

// lastLook settles a delivery that the middleware's own count leaves with
// no attempt, when a store inside knows the key (RetryConfig.StoreInside):
// the handler is called marked as having none (OfferLastLook), and the
// store answers whether an earlier delivery confirmed the key (a duplicate,
// acked), or refuses (dead-lettered, nothing run). A store that cannot
// answer, or a key held by a live claim, defers it as on any delivery.
func (r *retry) lastLook(h message.HandlerFunc, msg *message.Message, d delivery) ([]*message.Message, error) {
	rec := d.rec
	rec.BeginRun()
	rec.OfferLastLook()
	r.setAttempt(msg, rec, r.cfg.MaxAttempts)
	out, err := runRecovered(h, msg)
	_, _, refused := rec.Attempt()
	looked := rec.LastLookTaken()
	if !looked {
		// No store inside looked: the handler ran, once more than the
		// count allows. It was the last run.
		r.misplaced.Error("retry: the settle stack is misassembled; a handler ran with no attempt left", errNotLooked,
			watermill.LogFields{"handler": message.HandlerNameFromCtx(msg.Context()), "message_uuid": msg.UUID})
	}
	switch {
	case rec.Deferred():
		return out, err
	case refused:
		return nil, r.exhausted(msg, d, r.cfg.MaxAttempts, nil)
	case err == nil:
		// A duplicate (or, misassembled, a run that succeeded).
		r.tracked.Delete(d.key)
		return out, nil
	case settle.IsPermanent(err):
		rec.MarkPermanent()
		r.tracked.Delete(d.key)
		return out, err
	case !looked:
		return nil, r.exhausted(msg, d, r.cfg.MaxAttempts+1, err)
	}
	// The key could not be looked up for a reason of the message's own (its
	// key function failed): no attempt is left to try again.
	return nil, r.exhausted(msg, d, r.cfg.MaxAttempts, err)
}

// delivery is what is known, before a delivery runs, of earlier attempts.
type delivery struct {
	key trackKey
	rec *settlement.Record
	// prior: runs made before this delivery, when the middleware counts
	// them itself (no dedupe store inside); 0 otherwise.
	prior     int
	firstHint time.Time // first failure recorded on the message, if any
	// estimated: prior comes from the middleware's own sources, although
	// StoreCounts is set (a run no store counted).
	estimated bool
}

func (r *retry) setAttempt(msg *message.Message, rec *settlement.Record, n int) {
	rec.SetAttempt(n)
	msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(n))
}

// failed handles a run that did not succeed: returns a deferral as it is,
// parks what is permanent or exhausted, hands the message back to the
// broker, or retries it in process until a run succeeds or the in-process
// retries are used up. It is apart from the middleware's closure so that the
// closure's stack frame, on every message's path, stays small.
func (r *retry) failed(ctx context.Context, h message.HandlerFunc, msg *message.Message, d delivery, out []*message.Message, err error) ([]*message.Message, error) {
	rec := d.rec
	var bo *backoff.ExponentialBackOff // made on the first failure only
	for run := 1; ; run++ {
		if run > 1 {
			rec.BeginRun()
			r.setAttempt(msg, rec, d.prior+run)
			if out, err = runRecovered(h, msg); err == nil && !rec.Deferred() {
				r.tracked.Delete(d.key)
				return out, nil
			}
		}
		attempt, counted, refused := rec.Attempt()
		switch {
		case rec.Deferred():
			// Not an attempt: the key is busy, the store cannot answer, or a
			// copy could not be parked. Whoever deferred it has waited.
			return out, err
		case refused:
			// The dedupe store did not start the handler: its count says the
			// attempts are used up.
			return nil, r.exhausted(msg, d, attempt-1, err)
		case settle.IsPermanent(err):
			rec.MarkPermanent()
			r.tracked.Delete(d.key)
			return out, err
		}
		if !counted {
			if r.cfg.StoreCounts && !d.estimated {
				// No store counted the run, although one was said to: the
				// middleware's own count keeps the bound.
				r.misplaced.Error("retry: the settle stack is misassembled; counting the run in this process", errNotCounted,
					watermill.LogFields{"handler": message.HandlerNameFromCtx(ctx), "message_uuid": msg.UUID})
				r.source(msg, &d)
				d.estimated = true
			}
			attempt = d.prior + run
		}
		msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(attempt))
		r.tracked.Update(d.key, func(f *failures, found bool) *failures {
			now := time.Now()
			if !found {
				f = &failures{}
				switch {
				case !d.firstHint.IsZero() && d.firstHint.Before(now):
					f.first = d.firstHint
				case attempt == 1:
					f.first = now
				} // else earlier attempts failed where no one saw them: unknown
			}
			f.runs++
			f.last, f.lastErr = now, err
			return f
		})
		trace.SpanFromContext(ctx).AddEvent("settle.attempt_failed", trace.WithAttributes(
			attribute.Int("settle.attempt", attempt), attribute.String("exception.message", telemetry.Text(err.Error()))))
		if attempt >= r.cfg.MaxAttempts {
			return nil, r.exhausted(msg, d, attempt, err)
		}
		if bo == nil {
			bo = r.newBackoff()
		}
		wait := bo.NextBackOff()
		if run > r.cfg.InProcessRetries {
			return r.handBack(msg, d, attempt, max(wait, r.cfg.RedeliveryDelay), err)
		}
		rec.Retried()
		r.cfg.Logger.Debug("retry: handler failed; retrying in process", watermill.LogFields{
			"message_uuid": msg.UUID, "attempt": attempt, "backoff": wait.String(), "err": err.Error(),
		})
		if !settlement.Sleep(ctx, wait) {
			rec.SetOutcome(settlement.Retry)
			return nil, errors.Join(err, ctx.Err())
		}
	}
}

// prepare fills in what is known of earlier runs before a delivery runs: the
// first failure the message records, and, unless a store counts
// (StoreCounts), what the middleware's own sources say (source).
func (r *retry) prepare(msg *message.Message, d *delivery) {
	// Parse only what is there: a failed parse allocates its error.
	if v := msg.Metadata.Get(settle.MetaFirstFailure); v != "" {
		if t, err := time.Parse(park.TimeFormat, v); err == nil {
			d.firstHint = t
		}
	}
	if !r.cfg.StoreCounts {
		r.source(msg, d)
	}
}

// source fills in what the message and this process know of earlier runs,
// for a handler whose runs no dedupe store counts (RetryConfig.StoreCounts
// unset).
func (r *retry) source(msg *message.Message, d *delivery) {
	if r.cfg.Republish != nil {
		if v, ok := markedAttempt(r.cfg.RepublishKey, msg); ok {
			if n, err := strconv.Atoi(v); err == nil && n >= 0 {
				d.prior = n
				return
			}
		}
	}
	if v := msg.Metadata.Get(settle.MetaDeliveryCount); v != "" && deliverymark.Verify(msg.UUID, v, msg.Metadata.Get(deliverymark.Meta)) {
		if n, err := strconv.Atoi(v); err == nil && n >= 1 {
			// Each earlier delivery may have used all its runs.
			d.prior = min(n-1, r.cfg.MaxAttempts) * (1 + r.cfg.InProcessRetries)
			return
		}
	}
	if f, ok := r.tracked.Get(d.key); ok {
		d.prior = f.runs
	}
}

// exhausted builds the error the dead-letter parking parks. The failure
// record is kept: if the dead-letter publish fails and the message comes
// back, the per-process count must still say that no attempt is left.
func (r *retry) exhausted(msg *message.Message, d delivery, attempts int, err error) error {
	var first, last time.Time
	if f, ok := r.tracked.Get(d.key); ok {
		first, last = f.first, f.last
		if err == nil || last.IsZero() {
			err = f.lastErr
		} else if f.lastErr != nil && !errors.Is(err, f.lastErr) {
			// A refusal after failures this process saw: the failure is the
			// reason worth reading.
			err = errors.Join(f.lastErr, err)
		}
	}
	if err == nil {
		err = fmt.Errorf("no attempt left: %d made", attempts)
	}
	if first.IsZero() {
		first = d.firstHint
	}
	if first.IsZero() {
		// No process that saw the first failure is left (a crash loop): the
		// store dates the first attempt, which is when it began.
		first = d.rec.FirstAttempt()
	}
	if last.IsZero() {
		last = time.Now()
	}
	if first.After(last) {
		first = last // a first-failure time from the future is not believed
	}
	msg.Metadata.Set(settle.MetaAttempt, strconv.Itoa(attempts))
	return &ExhaustedError{Err: err, Attempts: attempts, FirstFailure: first, LastFailure: last}
}

// handBack returns the message to the broker after wait: by nack, or by
// republishing a copy and acking. Where the broker holds a nack for a delay
// of its own, it waits only for what that delay leaves of wait before
// nacking.
func (r *retry) handBack(msg *message.Message, d delivery, attempt int, wait time.Duration, err error) ([]*message.Message, error) {
	ctx := msg.Context()
	r.cfg.Logger.Debug("retry: handing the message back for redelivery", watermill.LogFields{
		"message_uuid": msg.UUID, "attempt": attempt, "delay": wait.String(), "err": err.Error(),
	})
	d.rec.SetOutcome(settlement.Retry)
	if r.cfg.Republish == nil {
		// A broker that holds a nacked delivery itself before redelivering
		// it (JetStream's NakWithDelay, as natsjs configures the
		// subscriber, which says so on the message) waits that long instead
		// of this goroutine and the router slot it holds.
		wait -= deliverymark.NakDelay(msg)
	}
	if !settlement.Sleep(ctx, wait) {
		return nil, errors.Join(err, ctx.Err())
	}
	if r.cfg.Republish == nil {
		return nil, err
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	if topic == "" {
		return nil, errors.Join(err, errors.New("retry: cannot republish: no subscribe topic in the message context"))
	}
	var first, last time.Time
	if f, ok := r.tracked.Get(d.key); ok {
		first, last = f.first, f.last
	}
	cp := park.Copy(msg, park.Info{Outcome: settle.Retry, Reason: err.Error(), Attempt: attempt, FirstFailure: first, LastFailure: last})
	cp.Metadata.Set(MetaAttemptMark, attemptMark(r.cfg.RepublishKey, topic, cp.UUID, cp.Metadata.Get(settle.MetaAttempt)))
	if perr := r.cfg.Republish.Publish(topic, cp); perr != nil {
		return nil, errors.Join(err, fmt.Errorf("retry: republish to %q: %w", topic, perr))
	}
	r.tracked.Delete(d.key)
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
