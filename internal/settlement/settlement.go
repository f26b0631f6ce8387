// Package settlement is the record of how one delivery settles, shared by
// settle's middleware through the message's context. The outermost settle
// middleware creates it; each middleware inside reads and writes it: the
// retry middleware writes the attempt limit, the dedupe middleware the
// durable attempt count or a deferral, the parking middlewares where a copy
// went. It lives in an internal package so that only settle's own middleware
// can write it; users read it through settle.SettlementFromContext.
package settlement

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
)

// Outcome names, as in package settle (which this package cannot import).
const (
	Done         = "done"
	Duplicate    = "duplicate"
	Deferred     = "deferred"
	Retry        = "retry"
	DeadLettered = "dead_lettered"
	Poisoned     = "poisoned"
)

// Record is the settlement of one delivery. Its methods are nil-safe: a
// middleware that finds no record records nothing.
type Record struct {
	// Propagator writes trace context into messages published while
	// settling (parked copies). Nil means none.
	Propagator propagation.TextMapPropagator
	// SpanAttributes identify the delivery on every span settle starts while
	// settling it (messaging.system, settle.handler). Set by the tracing
	// middleware; nil means none.
	SpanAttributes []attribute.KeyValue

	mu       sync.Mutex
	outcome  string
	retries  int
	parkedTo string
	reason   error
	key      string // the dedupe key, as the key function gave it

	firstAt     time.Time // start of the first attempt, from a durable store; zero: unknown
	limit       int       // attempts allowed per handler and message; 0: none
	storeCounts bool      // the retry middleware leaves counting to a store inside it
	attempt     int       // attempt number of the run in progress, from a durable count
	counted     bool      // attempt was set by a durable count for this run
	refused     bool      // a durable count refused to start the handler: attempts used up
	deferred    bool      // this run was deferred: no attempt was made
	lastLook    bool      // no attempt left: a store inside only says whether the key is confirmed
	looked      bool      // a store inside took the last look (NoAttemptLeft)
	permanent   bool

	payloadLeftOut int  // bytes of payload the parked copy does not carry
	leftOutStored  bool // the parked-message store holds that payload
}

// LeaveOutPayload records that the parked copy does not carry the
// message's payload of n bytes, and whether a parked-message store holds it.
func (r *Record) LeaveOutPayload(n int, stored bool) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.payloadLeftOut, r.leftOutStored = n, stored
	r.mu.Unlock()
}

// PayloadLeftOut returns what LeaveOutPayload recorded: 0 when the copy
// carries its payload.
func (r *Record) PayloadLeftOut() (n int, stored bool) {
	if r == nil {
		return 0, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.payloadLeftOut, r.leftOutStored
}

type key struct{}

// New returns ctx carrying a new record.
func New(ctx context.Context, p propagation.TextMapPropagator) (context.Context, *Record) {
	r := &Record{Propagator: p}
	return context.WithValue(ctx, key{}, r), r
}

// Ensure returns ctx's record, or ctx carrying a new one when it has none
// (the caller is then the outermost settle middleware).
func Ensure(ctx context.Context) (context.Context, *Record, bool) {
	if r := FromContext(ctx); r != nil {
		return ctx, r, false
	}
	ctx, r := New(ctx, nil)
	return ctx, r, true
}

// FromContext returns ctx's record, or nil.
func FromContext(ctx context.Context) *Record {
	r, _ := ctx.Value(key{}).(*Record)
	return r
}

// SetOutcome records the outcome decided so far; a later call overrides an
// earlier one, since outer middleware decide last.
func (r *Record) SetOutcome(o string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.outcome = o
	r.mu.Unlock()
}

// Attributes returns SpanAttributes; nil-safe.
func (r *Record) Attributes() []attribute.KeyValue {
	if r == nil {
		return nil
	}
	return r.SpanAttributes
}

// NoDelay is settle.NoDelay: given to a delay field whose zero value means
// its default, it means no delay at all.
const NoDelay time.Duration = -1

// Delay applies a delay field's default: def when d is unset (zero), none
// for NoDelay, d otherwise.
func Delay(d, def time.Duration) time.Duration {
	switch d {
	case 0:
		return def
	case NoDelay:
		return 0
	}
	return d
}

// SetFirstAttempt records when the first attempt of this handler on this
// message started, as a durable store knows it (the key's first claim).
func (r *Record) SetFirstAttempt(t time.Time) {
	if r == nil || t.IsZero() {
		return
	}
	r.mu.Lock()
	r.firstAt = t
	r.mu.Unlock()
}

// FirstAttempt returns what SetFirstAttempt recorded, zero if nothing.
func (r *Record) FirstAttempt() time.Time {
	if r == nil {
		return time.Time{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.firstAt
}

// Undecide forgets the outcome decided so far and a deferral: for a delivery
// whose settlement is decided again, as a batch run again without a failing
// message decides each of its deliveries again.
func (r *Record) Undecide() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.outcome, r.deferred = "", false
	r.mu.Unlock()
}

// Park records that a copy was stored on topic with outcome o because of
// reason.
func (r *Record) Park(o, topic string, reason error) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.outcome, r.parkedTo, r.reason, r.deferred = o, topic, reason, false
	r.mu.Unlock()
}

// SetKey records the delivery's dedupe key for its handler, as the key
// function gave it (not the stored, scoped form): the dedupe middleware, or
// a transactional handler that claims its keys itself, writes it once the
// key is known, and a parking middleware outside reads it for the parked
// record.
func (r *Record) SetKey(key string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.key = key
	r.mu.Unlock()
}

// Key returns what SetKey recorded, "" if nothing.
func (r *Record) Key() string {
	if r == nil {
		return ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.key
}

// Retried counts one in-process retry of a failed handler run.
func (r *Record) Retried() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.retries++
	r.mu.Unlock()
}

// Defer records that the delivery is nacked without an attempt: the key is
// busy, the store cannot answer, or a message could not be parked.
func (r *Record) Defer() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.outcome, r.deferred = Deferred, true
	r.mu.Unlock()
}

// Deferred reports whether the run in progress was deferred.
func (r *Record) Deferred() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.deferred
}

// BeginRun clears what a run records about itself, before the retry
// middleware runs the handler (again).
func (r *Record) BeginRun() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.attempt, r.counted, r.refused, r.deferred = 0, false, false, false
	r.lastLook, r.looked = false, false
	if r.outcome == Deferred {
		r.outcome = ""
	}
	r.mu.Unlock()
}

// OfferLastLook records, for the run about to start, that the retry
// middleware's own count (the broker's delivery count, say) leaves no
// attempt: the handler must not run, and a store inside that knows the key
// (the dedupe middleware, or a transactional handler that claims its key in
// its transaction) only says whether an earlier delivery confirmed it: a
// duplicate, or a refusal (Refuse).
func (r *Record) OfferLastLook() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.lastLook = true
	r.mu.Unlock()
}

// NoAttemptLeft reports whether the run in progress has no attempt left
// (OfferLastLook). When it does, it records that a store inside took the
// last look (LastLookTaken), so call it only where the key's state is
// looked up and the handler is not run.
func (r *Record) NoAttemptLeft() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lastLook {
		r.looked = true
	}
	return r.lastLook
}

// LastLookTaken reports whether a store inside took the last look offered
// for the run in progress (NoAttemptLeft).
func (r *Record) LastLookTaken() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.looked
}

// SetLimit records the attempt limit (the retry middleware's MaxAttempts)
// and whether the retry middleware leaves the count of attempts, and the
// decision to start a run, to a store inside it (RetryConfig.StoreCounts).
func (r *Record) SetLimit(n int, storeCounts bool) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.limit, r.storeCounts = n, storeCounts
	r.mu.Unlock()
}

// Limit returns the attempt limit, 0 when none is set, and whether the retry
// middleware that set it leaves the count to a store (see SetLimit).
func (r *Record) Limit() (limit int, storeCounts bool) {
	if r == nil {
		return 0, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.limit, r.storeCounts
}

// Count records the durable attempt number of the run about to start (the
// dedupe claim's count, this run included).
func (r *Record) Count(attempt int) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.attempt, r.counted = attempt, true
	r.mu.Unlock()
}

// Refuse records that a durable count refused to start the handler: the
// attempt about to start would be beyond the limit.
func (r *Record) Refuse(attempt int) {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.attempt, r.refused = attempt, true
	r.mu.Unlock()
}

// Attempt returns the attempt number of the run in progress and whether a
// durable count set it, and whether that count refused the run.
func (r *Record) Attempt() (attempt int, counted, refused bool) {
	if r == nil {
		return 0, false, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.attempt, r.counted, r.refused
}

// SetAttempt records the attempt number of the run in progress as the retry
// middleware estimates it, unless a durable count set it.
func (r *Record) SetAttempt(n int) {
	if r == nil {
		return
	}
	r.mu.Lock()
	if !r.counted {
		r.attempt = n
	}
	r.mu.Unlock()
}

// MarkPermanent records that the handler failed with an error no retry can
// fix: the poison parking middleware parks it.
func (r *Record) MarkPermanent() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.permanent = true
	r.mu.Unlock()
}

// Permanent reports whether MarkPermanent was called.
func (r *Record) Permanent() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.permanent
}

// Snapshot returns the recorded outcome ("" if none), the number of
// in-process retries, and the topic a copy was parked on with the failure
// that sent it there.
func (r *Record) Snapshot() (outcome string, retries int, parkedTo string, reason error) {
	if r == nil {
		return "", 0, "", nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.outcome, r.retries, r.parkedTo, r.reason
}

// Sleep waits for d or until ctx is done, and reports whether it waited the
// whole time.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Scope returns the logical handler a delivery belongs to: the router
// handler's name from ctx, without the "#n" suffix that a pipeline gives its
// handler's competing subscriptions (name, name#2, ...), which share one
// scope. Attempts are counted per scope and message.
func Scope(ctx context.Context) string { return ScopeOf(message.HandlerNameFromCtx(ctx)) }

// ScopeOf returns the scope of the router handler named h.
func ScopeOf(h string) string {
	i := strings.LastIndexByte(h, '#')
	if i <= 0 || i == len(h)-1 {
		return h
	}
	for _, c := range h[i+1:] {
		if c < '0' || c > '9' {
			return h
		}
	}
	return h[:i]
}

// RateLog logs errors of one kind at a rate a person can read: the first at
// once, then at most one per interval, saying how many were left out.
type RateLog struct {
	log      watermill.LoggerAdapter
	interval time.Duration

	mu      sync.Mutex
	last    time.Time
	skipped int
}

// NewRateLog returns a RateLog writing to log.
func NewRateLog(log watermill.LoggerAdapter, interval time.Duration) *RateLog {
	if log == nil {
		log = watermill.NopLogger{}
	}
	return &RateLog{log: log, interval: interval}
}

// Error logs msg unless one was logged less than the interval ago.
func (l *RateLog) Error(msg string, err error, fields watermill.LogFields) {
	now := time.Now()
	l.mu.Lock()
	if !l.last.IsZero() && now.Sub(l.last) < l.interval {
		l.skipped++
		l.mu.Unlock()
		return
	}
	skipped := l.skipped
	l.last, l.skipped = now, 0
	l.mu.Unlock()
	if skipped > 0 {
		fields = fields.Add(watermill.LogFields{"similar_errors_not_logged": skipped})
	}
	l.log.Error(msg, err, fields)
}
