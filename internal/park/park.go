// Package park publishes a copy of a failed message to a dead-letter or
// poison topic, with metadata saying why, and acks the original only when the
// copy is stored. The poison and dead-letter middlewares are both built on it.
package park

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
)

// Info is what a parked copy records about the failure.
type Info struct {
	Outcome      settle.Outcome
	Reason       string
	Attempt      int       // 0 if unknown
	FirstFailure time.Time // zero: the time of parking
	LastFailure  time.Time // zero: the time of parking
}

// TimeFormat is the layout of the failure-time metadata.
const TimeFormat = time.RFC3339Nano

// Copy returns the copy of msg to publish: same UUID, payload and metadata,
// plus settle's failure metadata. The original topic and handler come from
// the router's context.
func Copy(msg *message.Message, info Info) *message.Message {
	now := time.Now().UTC()
	cp := msg.Copy()
	cp.SetContext(msg.Context())
	ctx := msg.Context()
	md := cp.Metadata
	md.Set(settle.MetaOutcome, string(info.Outcome))
	md.Set(settle.MetaReason, info.Reason)
	if t := message.SubscribeTopicFromCtx(ctx); t != "" {
		md.Set(settle.MetaOriginalTopic, t)
	}
	if h := message.HandlerNameFromCtx(ctx); h != "" {
		md.Set(settle.MetaHandler, h)
	}
	md.Set(settle.MetaOriginalUUID, msg.UUID)
	if info.Attempt > 0 {
		md.Set(settle.MetaAttempt, strconv.Itoa(info.Attempt))
	}
	first, last := info.FirstFailure, info.LastFailure
	if first.IsZero() {
		first = now
	}
	if last.IsZero() {
		last = now
	}
	md.Set(settle.MetaFirstFailure, first.UTC().Format(TimeFormat))
	md.Set(settle.MetaLastFailure, last.UTC().Format(TimeFormat))
	return cp
}

// Config configures a terminal middleware.
type Config struct {
	Publisher message.Publisher
	Topic     string
	// Match says whether err is to be parked, and what to record.
	Match func(msg *message.Message, err error) (Info, bool)
	// NackDelay is how long to wait before nacking when the publish failed,
	// so that an unreachable dead-letter topic does not become a hot loop.
	NackDelay time.Duration
	Logger    watermill.LoggerAdapter
	// Name prefixes errors and log lines ("poison", "deadletter").
	Name string
}

// Defaults fills the NackDelay (1s) and Logger (watermill.NopLogger) that
// every terminal middleware's config shares, where they are zero.
func Defaults(nackDelay *time.Duration, logger *watermill.LoggerAdapter) {
	if *nackDelay == 0 {
		*nackDelay = time.Second
	}
	if *logger == nil {
		*logger = watermill.NopLogger{}
	}
}

// Validate checks the fields every terminal middleware's config shares.
// cfgName prefixes the field names in the errors ("poison: Config").
func Validate(cfgName string, pub message.Publisher, topic string, nackDelay time.Duration) error {
	switch {
	case pub == nil:
		return errors.New(cfgName + ".Publisher is required")
	case topic == "":
		return errors.New(cfgName + ".Topic is required")
	case nackDelay < 0:
		return fmt.Errorf("%s.NackDelay must be >= 0, got %v", cfgName, nackDelay)
	}
	return nil
}

// ErrPublish is wrapped when the copy could not be published; the original
// is then nacked.
var ErrPublish = errors.New("publishing the parked copy failed; message nacked")

// Middleware returns the terminal middleware: a matching error is parked and
// the original acked; anything else passes through unchanged.
func Middleware(cfg Config) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			return cfg.failed(msg, out, err)
		}
	}
}

// failed handles a handler error: parks a copy of msg when cfg.Match says
// so. It is apart from the middleware's closure so that the closure's stack
// frame, on every message's path, stays small.
func (cfg *Config) failed(msg *message.Message, out []*message.Message, err error) ([]*message.Message, error) {
	info, ok := cfg.Match(msg, err)
	if !ok {
		return out, err
	}
	cp := Copy(msg, info)
	perr := publish(msg.Context(), cfg.Publisher, cfg.Topic, cp)
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "topic": cfg.Topic, "outcome": string(info.Outcome), "attempt": info.Attempt,
	}
	if perr == nil {
		settle.SettlementFromContext(msg.Context()).Parked(info.Outcome, cfg.Topic, err)
		cfg.Logger.Info(cfg.Name+": message parked", fields.Add(watermill.LogFields{"reason": info.Reason}))
		return nil, nil
	}
	cfg.Logger.Error(cfg.Name+": could not publish parked copy; nacking", perr, fields)
	if cfg.NackDelay > 0 {
		t := time.NewTimer(cfg.NackDelay)
		select {
		case <-t.C:
		case <-msg.Context().Done():
			t.Stop()
		}
	}
	return nil, errors.Join(err, fmt.Errorf("%s: %w: topic %q: %w", cfg.Name, ErrPublish, cfg.Topic, perr))
}

// ScopeName is the instrumentation scope of the spans of parked copies.
const ScopeName = "github.com/settle-go/settle/middleware"

// publish sends the copy inside a producer span that is a child of the
// delivery's span (if the delivery is traced) and writes that span's context
// into the copy, so the copy's trace leads back to the failed delivery.
func publish(ctx context.Context, pub message.Publisher, topic string, cp *message.Message) error {
	parent := trace.SpanFromContext(ctx)
	if !parent.SpanContext().IsValid() {
		return pub.Publish(topic, cp)
	}
	s := settle.SettlementFromContext(ctx)
	var ids []attribute.KeyValue
	if s != nil {
		ids = s.SpanAttributes
	}
	ctx, span := parent.TracerProvider().Tracer(ScopeName).Start(ctx, "send "+topic,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(ids...),
		trace.WithAttributes(
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(topic),
			semconv.MessagingMessageID(cp.UUID),
			attribute.String("settle.outcome", cp.Metadata.Get(settle.MetaOutcome)),
		))
	defer span.End()
	if s != nil && s.Propagator != nil {
		s.Propagator.Inject(ctx, settle.MetadataCarrier(cp.Metadata))
	}
	cp.SetContext(ctx)
	err := pub.Publish(topic, cp)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	return err
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
