// Package park records a failed message in a parked-message store and
// publishes a copy of it to a dead-letter or poison topic, with metadata
// saying why (either or both), and acks the original only when the record
// is committed and the copy stored. The poison and dead-letter parking
// middlewares are both built on it.
package park

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/deliverymark"
	"github.com/settle-go/settle/internal/lru"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/internal/telemetry"
)

// Info is what a parked copy records about the failure.
type Info struct {
	Outcome      settle.Outcome
	Reason       string
	Cause        error     // the error Reason is the text of (settle.Parked.Cause)
	Attempt      int       // 0 if unknown
	FirstFailure time.Time // zero: unknown, the copy carries no first-failure time
	LastFailure  time.Time // zero: the time of parking
}

// MetaAttemptMark is the metadata key of the retry middleware's mark on a
// copy it republished (middleware.MetaAttemptMark). A parked copy never
// carries one: the mark vouches for one republished copy only.
const MetaAttemptMark = "settle_attempt_mark"

// TimeFormat is the layout of the failure-time metadata.
const TimeFormat = time.RFC3339Nano

// Bounds on what a copy carries, so that a copy is always publishable: a
// broker takes a message's headers in one frame (RabbitMQ: frame_max,
// 128 KiB by default), and a message it accepted can carry headers whose
// text form (base64 of a binary header) no longer fits once settle's own
// metadata is added.
const (
	// DefaultMaxMetadata is the default bound on a copy's metadata, keys
	// and values together with the UUID: half of RabbitMQ's default
	// frame_max, leaving room for the marshaler's own headers and the
	// properties.
	DefaultMaxMetadata = 64 << 10
	// MaxReason bounds settle_reason; a longer error text is cut, on a
	// UTF-8 boundary, and says how much was cut.
	MaxReason = 4 << 10
	// minimalReason bounds settle_reason on a minimal copy.
	minimalReason = 512
	// maxUUIDText bounds settle_original_uuid (the copy keeps its UUID).
	maxUUIDText = 1 << 10
	// maxDroppedText bounds MetaDroppedHeaders.
	maxDroppedText = 2 << 10
	// MaxEntries bounds the number of a copy's metadata entries. RabbitMQ
	// takes a table of any length, but amqp091 (under watermill-amqp,
	// amqpsub and the settle command) refuses to read one of more than
	// 8192 entries: an original just under that, plus settle's own
	// entries, made a copy that nobody could read back. The rest of the
	// 8192 is left to the marshaler's own headers.
	MaxEntries = 8000
)

// MetaDroppedHeaders is the metadata key under which a copy says which of
// the original's metadata entries it does not carry, because the copy would
// not have fitted: a JSON object {"count":N,"bytes":B,"names":[...]} (names
// as many as fit in 2 KiB, each invalid UTF-8 byte as U+FFFD). The payload
// is never changed. Absent when nothing was dropped.
const MetaDroppedHeaders = "settle_dropped_headers"

// Limits bound a copy.
type Limits struct {
	// MaxMetadata bounds the copy's metadata: the sum of len(key) +
	// len(value) + 6 over its entries and the UUID. Zero means
	// DefaultMaxMetadata.
	MaxMetadata int
	// Minimal keeps none of the original's metadata, only settle's, with a
	// shorter reason: the copy of last resort, for a message whose full
	// copy could not be published.
	Minimal bool
	// MaxMessage bounds the copy's payload and metadata together (metadata
	// counted as for MaxMetadata), as a broker that takes at most so many
	// bytes in one message needs (NATS: max_payload). Zero means no
	// bound. When even settle's own metadata does not fit beside the
	// payload, the copy carries no payload, and MetaPayloadLeftOut says so.
	MaxMessage int
}

// MetaPayloadLeftOut is the metadata key under which a copy says that it
// does not carry its original's payload, because the payload alone left no
// room for settle's metadata within the most the broker takes in one
// message (Limits.MaxMessage): a JSON object {"bytes":N,"sha256":"..."}
// naming the payload left out. Absent when the copy carries the payload.
const MetaPayloadLeftOut = "settle_payload_left_out"

// BrokerLimits is implemented by a publisher that knows the most its broker
// takes in one message (natsjs.NewPublisher). MessageLimits returns the bounds
// in settle's count (Limits.MaxMetadata): metadata the most a message's
// metadata and UUID may take, total the most its payload and metadata may
// take together; zero for no bound. The publisher leaves room in them for
// its own encoding's fixed overhead.
type BrokerLimits interface {
	MessageLimits() (metadata, total int)
}

// LimitsOf returns the bounds pub's broker sets on one message (see
// BrokerLimits); zero when pub says nothing.
func LimitsOf(pub message.Publisher) (metadata, total int) {
	if bl, ok := pub.(BrokerLimits); ok {
		return bl.MessageLimits()
	}
	return 0, 0
}

// Copy returns the copy of msg to publish: same UUID, payload and metadata,
// plus settle's failure metadata, within DefaultMaxMetadata. The original
// topic and handler come from the router's context. A first-failure time
// that is not known is left out rather than made up.
func Copy(msg *message.Message, info Info) *message.Message {
	return CopyWithin(msg, info, Limits{})
}

// CopyWithin is Copy within lim: settle's values are bounded (the reason at
// MaxReason, made valid UTF-8), and when the copy's metadata is still over
// lim.MaxMetadata, the original's entries are left out, largest first, until
// it fits; MetaDroppedHeaders names them.
func CopyWithin(msg *message.Message, info Info, lim Limits) *message.Message {
	now := time.Now().UTC()
	maxMD := lim.MaxMetadata
	if maxMD <= 0 {
		maxMD = DefaultMaxMetadata
	}
	cp := message.NewMessage(msg.UUID, msg.Payload)
	cp.SetContext(msg.Context())
	ctx := msg.Context()
	own := make(message.Metadata, 10)
	reasonMax := MaxReason
	if lim.Minimal {
		reasonMax = minimalReason
	}
	if lim.MaxMessage > 0 {
		// What the payload leaves of the broker's bound. When settle's own
		// entries (the reason at its shortest) would not fit in it, the
		// payload is left out: a copy that can never be published would
		// defer its original for ever.
		room := lim.MaxMessage - len(msg.Payload)
		if room < maxMD {
			maxMD = room
		}
		if maxMD < minimalOwn(msg) {
			maxMD = min(lim.MaxMetadata, lim.MaxMessage)
			if maxMD <= 0 {
				maxMD = lim.MaxMessage
			}
			cp.Payload = nil
			sum := sha256.Sum256(msg.Payload)
			own.Set(MetaPayloadLeftOut, fmt.Sprintf(`{"bytes":%d,"sha256":"%s"}`, len(msg.Payload), hex.EncodeToString(sum[:])))
		} else if maxMD < DefaultMaxMetadata/2 {
			reasonMax = minimalReason // the room is scarce: a short reason leaves more to the original's entries
		}
	}
	own.Set(settle.MetaOutcome, string(info.Outcome))
	own.Set(settle.MetaReason, cut(info.Reason, reasonMax))
	if t := message.SubscribeTopicFromCtx(ctx); t != "" {
		own.Set(settle.MetaOriginalTopic, bound(t, maxUUIDText))
	}
	if h := message.HandlerNameFromCtx(ctx); h != "" {
		own.Set(settle.MetaHandler, bound(h, maxUUIDText))
	}
	own.Set(settle.MetaOriginalUUID, bound(msg.UUID, maxUUIDText))
	if info.Attempt > 0 {
		own.Set(settle.MetaAttempt, strconv.Itoa(info.Attempt))
	}
	last := info.LastFailure
	if last.IsZero() {
		last = now
	}
	if first := info.FirstFailure; !first.IsZero() {
		if first.After(last) {
			first = last
		}
		own.Set(settle.MetaFirstFailure, first.UTC().Format(TimeFormat))
	}
	own.Set(settle.MetaLastFailure, last.UTC().Format(TimeFormat))

	// The original's entries, less those settle writes or a copy must not
	// carry.
	type entry struct{ k, v string }
	var orig []entry
	size := entrySize("", msg.UUID)
	for k, v := range own {
		size += entrySize(k, v)
	}
	for k, v := range msg.Metadata {
		if _, mine := own[k]; mine {
			continue
		}
		switch k {
		case MetaAttemptMark, MetaDroppedHeaders, MetaPayloadLeftOut, settle.MetaFirstFailure, deliverymark.Meta, deliverymark.MetaNakDelay, deliverymark.MetaNakDelayMark:
			continue
		}
		orig = append(orig, entry{k, v})
		size += entrySize(k, v)
	}
	var dropped []entry
	if lim.Minimal {
		dropped, orig = orig, nil
	} else if size > maxMD || len(orig)+len(own)+1 > MaxEntries {
		// Leave out the largest first: the fewest entries lost.
		sort.Slice(orig, func(i, j int) bool {
			a, b := entrySize(orig[i].k, orig[i].v), entrySize(orig[j].k, orig[j].v)
			if a != b {
				return a > b
			}
			return orig[i].k < orig[j].k
		})
		budget := maxMD - maxDroppedText - len(MetaDroppedHeaders)
		for len(orig) > 0 && (size > budget || len(orig)+len(own)+1 > MaxEntries) {
			size -= entrySize(orig[0].k, orig[0].v)
			dropped = append(dropped, orig[0])
			orig = orig[1:]
		}
	}
	for _, e := range orig {
		cp.Metadata[e.k] = e.v
	}
	for k, v := range own {
		cp.Metadata[k] = v
	}
	if len(dropped) > 0 {
		names := make([]string, len(dropped))
		total := 0
		for i, e := range dropped {
			names[i] = e.k
			total += len(e.k) + len(e.v)
		}
		sort.Strings(names)
		cp.Metadata[MetaDroppedHeaders] = droppedText(len(dropped), total, names)
	}
	return cp
}

// minimalOwn is the most settle's own metadata on a copy of msg can take
// with the shortest reason, the UUID and room to name entries left out:
// the least room a copy needs beside its payload.
func minimalOwn(msg *message.Message) int {
	n := entrySize("", msg.UUID) + entrySize(MetaDroppedHeaders, "") + maxDroppedText
	n += entrySize(settle.MetaReason, "") + minimalReason
	n += entrySize(settle.MetaOutcome, string(settle.DeadLettered))
	n += entrySize(settle.MetaOriginalTopic, "") + maxUUIDText
	n += entrySize(settle.MetaHandler, "") + maxUUIDText
	n += entrySize(settle.MetaOriginalUUID, "") + min(len(msg.UUID), maxUUIDText)
	n += entrySize(settle.MetaAttempt, "-9223372036854775808")
	n += entrySize(settle.MetaFirstFailure, TimeFormat) + entrySize(settle.MetaLastFailure, TimeFormat)
	n += entrySize(MetaPayloadLeftOut, "") + 128
	return n
}

// entrySize is what one metadata entry takes in a copy: its key and value,
// and the 6 bytes an AMQP field table spends on an entry (the name's length,
// the type, the value's length), so that thousands of tiny headers are not
// taken for nothing.
func entrySize(k, v string) int { return len(k) + len(v) + 6 }

// bound returns s unchanged, byte for byte, when it is at most limit bytes
// (a UUID or a topic is an identifier: a replay looks for it as it is), and
// cut otherwise.
func bound(s string, limit int) string {
	if len(s) <= limit {
		return s
	}
	return cut(s, limit)
}

// cut returns s as valid UTF-8, at most max bytes: a longer text is cut on a
// rune boundary and ends saying how many bytes were cut.
func cut(s string, limit int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= limit {
		return s
	}
	n := max(limit-len(" [0000000000 bytes cut]"), 0)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + fmt.Sprintf(" [%d bytes cut]", len(s)-n)
}

// droppedText renders MetaDroppedHeaders within maxDroppedText: as many
// names as fit, each encoded once (a copy can leave out thousands).
func droppedText(count, total int, names []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `{"count":%d,"bytes":%d,"names":[`, count, total)
	for i, n := range names {
		q, err := json.Marshal(n) // valid UTF-8, each invalid byte as U+FFFD
		if err != nil || b.Len()+len(q)+3 > maxDroppedText {
			break
		}
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(q)
	}
	b.WriteString("]}")
	return b.String()
}

// Config configures a parking middleware: Store, or Publisher and Topic, or
// all three.
type Config struct {
	// Store, when not nil, records each parked message before its copy is
	// published and its original acked.
	Store settle.ParkStore
	// StoreTimeout, when > 0, bounds each Store.Park.
	StoreTimeout time.Duration
	Publisher    message.Publisher
	Topic        string
	// Initializer, when not nil, declares Topic before every copy is
	// published, so that the broker has somewhere to route it; a failed
	// declaration is a failed park.
	Initializer message.SubscribeInitializer
	// Match says whether the failed run is to be parked, and what to record.
	Match func(msg *message.Message, rec *settlement.Record, err error) (Info, bool)
	// NackDelay is how long to wait before nacking when the publish failed,
	// so that an unreachable parking topic does not become a hot loop.
	NackDelay time.Duration
	Logger    watermill.LoggerAdapter
	// Name prefixes errors and log lines ("poison", "deadletter").
	Name string
	// Pending bounds the messages remembered, per middleware, whose copy
	// could not be published: their redelivery is parked again without
	// running anything inside.
	Pending int
	// MaxMetadata bounds each copy's metadata (Limits.MaxMetadata).
	MaxMetadata int
}

// MinimalAfter is how many publishes of a message's full copy fail before
// its next copy is a minimal one (Limits.Minimal), which carries none of
// the original's metadata. A failed declaration of the topic does not
// count.
const MinimalAfter = 3

// Identity names a message in the per-process memories of the retry and
// parking middlewares: its UUID, or, for a message without one (a delivery
// with neither a UUID header nor a message-id), the SHA-256 of its payload.
// Messages without a UUID would otherwise share one entry: a good one
// erased a failing one's count, and a failing one's count, or its unparked
// copy, was taken for the next one's, which was dead-lettered without a
// run.
func Identity(msg *message.Message) string {
	if msg.UUID != "" {
		return msg.UUID
	}
	sum := sha256.Sum256(msg.Payload)
	return "\x00payload-sha256:" + hex.EncodeToString(sum[:])
}

// pendingKey names a message in the scope of one logical handler.
type pendingKey struct{ scope, uuid string }

// pendingCopy is what a redelivery needs to park its message again.
type pendingCopy struct {
	info   Info
	reason error
	key    string // the dedupe key, which a redelivery parked without a run does not learn
	fails  int    // publishes of the copy that failed
}

// ErrPublish is wrapped when the copy could not be published; the original
// is then nacked.
var ErrPublish = errors.New("publishing the parked copy failed; message nacked")

// ErrStore is wrapped when the parked-message store could not record the
// message; the original is then nacked.
var ErrStore = errors.New("recording the message in the parked-message store failed; message nacked")

type parker struct {
	cfg     Config
	pending *lru.Cache[pendingKey, pendingCopy]
	log     *settlement.RateLog
}

// Middleware returns the parking middleware: a matching failure is parked and
// the original acked; anything else passes through unchanged.
//
// A copy that cannot be published leaves the delivery deferred, not failed:
// it is nacked after NackDelay, no attempt is counted for it, and its
// redelivery is parked again at once, without running the middleware and
// handler inside (the handler that returned a permanent error is not run
// again; a message out of attempts is not claimed again). The middleware
// remembers such messages in memory, so after a restart of the consumer the
// redelivery goes through the stack again.
func Middleware(cfg Config) message.HandlerMiddleware {
	p := &parker{cfg: cfg, pending: lru.New[pendingKey, pendingCopy](cfg.Pending), log: settlement.NewRateLog(cfg.Logger, 5*time.Second)}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			// The outermost settle middleware creates the delivery's
			// settlement; tracing, when it runs, has done so already.
			if ctx, _, created := settlement.Ensure(msg.Context()); created {
				orig := msg.Context()
				msg.SetContext(ctx)
				defer msg.SetContext(orig)
			}
			if p.pending.Len() > 0 {
				if pc, ok := p.pending.Get(pendingKey{settlement.Scope(msg.Context()), Identity(msg)}); ok {
					return p.again(msg, pc)
				}
			}
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			return p.failed(msg, out, err)
		}
	}
}

// failed handles a failure: parks a copy of msg when cfg.Match says so. It
// is apart from the middleware's closure so that the closure's stack frame,
// on every message's path, stays small.
func (p *parker) failed(msg *message.Message, out []*message.Message, err error) ([]*message.Message, error) {
	rec := settlement.FromContext(msg.Context())
	if rec.Deferred() {
		return out, err // nothing was decided: the delivery comes back
	}
	info, ok := p.cfg.Match(msg, rec, err)
	if !ok {
		return out, err
	}
	return p.park(msg, pendingCopy{info: info, reason: err, key: rec.Key()})
}

// again parks a redelivered message that could not be parked before.
func (p *parker) again(msg *message.Message, pc pendingCopy) ([]*message.Message, error) {
	return p.park(msg, pc) // the failure, its text and its times, are the ones recorded
}

func (p *parker) park(msg *message.Message, pc pendingCopy) ([]*message.Message, error) {
	ctx := msg.Context()
	rec := settlement.FromContext(ctx)
	key := pendingKey{settlement.Scope(ctx), Identity(msg)}
	info := pc.info
	if info.LastFailure.IsZero() {
		// The time of parking, the same for the record and every copy of
		// it.
		info.LastFailure = time.Now()
		pc.info.LastFailure = info.LastFailure
	}
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "topic": p.cfg.Topic, "outcome": string(info.Outcome), "attempt": info.Attempt,
	}
	// The record first: the copy on the topic is published only once the
	// row is committed, and the original acked only after both.
	if p.cfg.Store != nil {
		if err := record(ctx, p.cfg.Store, p.cfg.StoreTimeout, p.parked(msg, pc.key, info)); err != nil {
			return p.deferred(msg, pc, key, false, fields, fmt.Errorf("%s: %w: %w", p.cfg.Name, ErrStore, err))
		}
	}
	minimal := pc.fails >= MinimalAfter
	leftOut := 0 // bytes of payload the copy does not carry
	if p.cfg.Publisher != nil {
		// The broker's own bounds on one message, when the publisher knows
		// them (natsjs.NewPublisher: NATS's header block and max_payload), so
		// that the copy is publishable the first time.
		maxMD := p.cfg.MaxMetadata
		mdLimit, msgLimit := LimitsOf(p.cfg.Publisher)
		if mdLimit > 0 && (maxMD <= 0 || mdLimit < maxMD) {
			maxMD = mdLimit
		}
		cp := CopyWithin(msg, info, Limits{MaxMetadata: maxMD, Minimal: minimal, MaxMessage: msgLimit})
		if cp.Metadata.Get(MetaPayloadLeftOut) != "" {
			leftOut = len(msg.Payload)
			if p.cfg.Store == nil {
				// Nothing else holds the payload: a copy without it would
				// lose it. The message stays on its queue, redelivered and
				// logged, until a store is configured or it is removed by
				// hand.
				return p.deferred(msg, pc, key, false, fields,
					fmt.Errorf("%s: %w (%d bytes), and no ParkConfig.Store holds the message: it stays on its queue", p.cfg.Name, ErrPayloadLeftOut, leftOut))
			}
		}
		perr := p.declare()
		declared := perr == nil
		if declared {
			perr = publish(ctx, p.cfg.Publisher, p.cfg.Topic, cp)
		}
		if perr != nil {
			return p.deferred(msg, pc, key, declared, fields, fmt.Errorf("%s: %w: topic %q: %w", p.cfg.Name, ErrPublish, p.cfg.Topic, perr))
		}
	}
	p.pending.Delete(key)
	rec.Park(string(info.Outcome), p.cfg.Topic, pc.reason)
	if minimal && p.cfg.Publisher != nil {
		p.cfg.Logger.Error(p.cfg.Name+": message parked with a minimal copy, without the original's metadata", ErrMinimal,
			fields.Add(watermill.LogFields{"failed_publishes": pc.fails}))
	}
	if leftOut > 0 {
		rec.LeaveOutPayload(leftOut, p.cfg.Store != nil)
		p.cfg.Logger.Error(p.cfg.Name+": message parked with a copy without its payload, which leaves no room for settle's metadata within the broker's bound on one message; the parked-message store holds the whole message", ErrPayloadLeftOut,
			fields.Add(watermill.LogFields{"payload_bytes": leftOut, "in_store": p.cfg.Store != nil}))
	}
	p.cfg.Logger.Info(p.cfg.Name+": message parked", fields.Add(watermill.LogFields{"reason": cut(info.Reason, MaxReason)}))
	return nil, nil
}

// parked is what the store records of msg.
func (p *parker) parked(msg *message.Message, key string, info Info) settle.Parked {
	ctx := msg.Context()
	cause := info.Cause
	if cause == nil {
		cause = errors.New(info.Reason)
	}
	var traceID string
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		traceID = sc.TraceID().String()
	}
	return settle.Parked{
		Message:      msg,
		Outcome:      info.Outcome,
		Cause:        cause,
		Handler:      settlement.Scope(ctx),
		Topic:        message.SubscribeTopicFromCtx(ctx),
		Key:          key,
		Attempts:     info.Attempt,
		FirstFailure: info.FirstFailure,
		LastFailure:  info.LastFailure,
		TraceID:      traceID,
	}
}

// deferred remembers a message that could not be parked, so that its
// redelivery is parked again without running anything inside, and defers
// its delivery: it is nacked after NackDelay, not an attempt. published
// says whether the failure was a publish of the copy where the topic could
// be declared, which counts towards the minimal copy.
func (p *parker) deferred(msg *message.Message, pc pendingCopy, key pendingKey, published bool, fields watermill.LogFields, err error) ([]*message.Message, error) {
	ctx := msg.Context()
	p.pending.Update(key, func(old pendingCopy, found bool) pendingCopy {
		if found && !old.info.FirstFailure.IsZero() {
			pc.info.FirstFailure = old.info.FirstFailure
		}
		if published {
			// Only a publish that failed where the topic could be declared
			// counts towards the minimal copy: a broker that cannot be
			// reached says nothing of the copy.
			pc.fails++
		}
		return pc
	})
	settlement.FromContext(ctx).Defer()
	p.log.Error(p.cfg.Name+": could not park the message; nacking, not counted as an attempt", err, fields)
	Sleep(ctx, p.cfg.NackDelay)
	return nil, errors.Join(pc.reason, err)
}

// ErrPayloadLeftOut is logged when a message is parked with a copy that
// does not carry its payload (MetaPayloadLeftOut).
var ErrPayloadLeftOut = errors.New("the payload alone is at the broker's bound on one message")

// ErrMinimal is logged when a message is parked with a minimal copy.
var ErrMinimal = fmt.Errorf("the full copy failed to publish %d times", MinimalAfter)

// ErrDeclare is wrapped when the parking topic could not be declared before
// a copy was published to it.
var ErrDeclare = errors.New("declaring the parking topic failed")

// declare makes sure the parking topic exists before a copy goes to it. It
// declares before every copy, not once: parking is rare, a declaration is
// one round trip, and a queue deleted while the consumer runs is declared
// again instead of swallowing the copies sent to it.
func (p *parker) declare() error {
	if p.cfg.Initializer == nil {
		return nil
	}
	if err := p.cfg.Initializer.SubscribeInitialize(p.cfg.Topic); err != nil {
		return fmt.Errorf("%w: %w", ErrDeclare, err)
	}
	return nil
}

// record writes the row of pk in store inside an internal span "park
// <topic>" (topic: the one the message was consumed from), a child of the
// delivery's span (if the delivery is traced), so that the trace shows
// where the message went when no copy is published. The Park has timeout
// (when > 0) as its deadline.
func record(ctx context.Context, store settle.ParkStore, timeout time.Duration, pk settle.Parked) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	parent := trace.SpanFromContext(ctx)
	if !parent.SpanContext().IsValid() {
		return store.Park(ctx, pk)
	}
	var ids []attribute.KeyValue
	if s := settlement.FromContext(ctx); s != nil {
		ids = s.SpanAttributes
	}
	name := "park"
	if pk.Topic != "" {
		name += " " + telemetry.ID(pk.Topic)
	}
	ctx, span := parent.TracerProvider().Tracer(telemetry.MiddlewareScope).Start(ctx, name,
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(ids...),
		trace.WithAttributes(
			semconv.MessagingDestinationName(telemetry.ID(pk.Topic)),
			telemetry.MessageID(pk.Message.UUID),
			attribute.String("settle.outcome", string(pk.Outcome)),
		))
	defer span.End()
	err := store.Park(ctx, pk)
	if err != nil {
		telemetry.RecordError(span, err)
	}
	return err
}

// publish sends the copy inside a producer span that is a child of the
// delivery's span (if the delivery is traced) and writes that span's context
// into the copy, so the copy's trace leads back to the failed delivery.
func publish(ctx context.Context, pub message.Publisher, topic string, cp *message.Message) error {
	parent := trace.SpanFromContext(ctx)
	if !parent.SpanContext().IsValid() {
		return pub.Publish(topic, cp)
	}
	s := settlement.FromContext(ctx)
	var ids []attribute.KeyValue
	if s != nil {
		ids = s.SpanAttributes
	}
	ctx, span := parent.TracerProvider().Tracer(telemetry.MiddlewareScope).Start(ctx, "send "+topic,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(ids...),
		trace.WithAttributes(
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(topic),
			telemetry.MessageID(cp.UUID),
			attribute.String("settle.outcome", cp.Metadata.Get(settle.MetaOutcome)),
		))
	defer span.End()
	if s != nil && s.Propagator != nil {
		s.Propagator.Inject(ctx, propagation.MapCarrier(cp.Metadata))
	}
	if lo := cp.Metadata.Get(MetaPayloadLeftOut); lo != "" {
		span.AddEvent("settle.payload_left_out", trace.WithAttributes(attribute.String(MetaPayloadLeftOut, lo)))
	}
	cp.SetContext(ctx)
	err := pub.Publish(topic, cp)
	if err != nil {
		telemetry.RecordError(span, err)
	}
	return err
}

// Sleep waits for d or until ctx is done, and reports whether it waited the
// whole time.
func Sleep(ctx context.Context, d time.Duration) bool { return settlement.Sleep(ctx, d) }
