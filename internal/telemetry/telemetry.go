package telemetry

import (
	"context"
	"reflect"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Bounds, in bytes, of what settle puts on a span from message data.
const (
	// MaxID bounds an identifier: a message ID, a topic, a span name.
	MaxID = 256
	// MaxText bounds a text: an error message, a status description.
	MaxText = 2048
)

// ellipsis marks a string that was cut.
const ellipsis = "…"

// Clean returns s as valid UTF-8 of at most max bytes: each run of invalid
// bytes becomes U+FFFD, and a longer string is cut at a rune boundary and
// ends with "…". A string already valid and short enough is returned as it
// is, without allocating.
func Clean(s string, max int) string {
	if len(s) <= max && utf8.ValidString(s) {
		return s
	}
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if len(s) <= max {
		return s
	}
	cut := max - len(ellipsis)
	if cut < 0 {
		cut = 0
	}
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}

// ID returns s cleaned as an identifier (MaxID).
func ID(s string) string { return Clean(s, MaxID) }

// Text returns s cleaned as a text (MaxText).
func Text(s string) string { return Clean(s, MaxText) }

// MessageID is messaging.message.id for id, cleaned.
func MessageID(id string) attribute.KeyValue { return semconv.MessagingMessageID(ID(id)) }

// RecordError records err on span as the SDK's RecordError does (an
// "exception" event with exception.type and exception.message), but with the
// message cleaned, and sets the span's status to Error with the same
// description.
func RecordError(span trace.Span, err error) {
	if err == nil {
		return
	}
	msg := Text(err.Error())
	span.AddEvent(semconv.ExceptionEventName, trace.WithAttributes(
		semconv.ExceptionType(typeName(err)),
		semconv.ExceptionMessage(msg),
	))
	span.SetStatus(codes.Error, msg)
}

// typeName names err's type as the SDK does for exception.type.
func typeName(err error) string {
	t := reflect.TypeOf(err)
	if t.PkgPath() == "" && t.Name() == "" {
		return t.String()
	}
	return t.PkgPath() + "." + t.Name()
}

// w3c is what settle propagates with when the application has not chosen.
var w3c propagation.TextMapPropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Propagator returns the propagator settle uses when none is given: OTel's
// global one (as it is when this is called) once it propagates anything,
// and W3C Trace Context and Baggage while it is the no-op that OTel starts
// with. So a program that never calls otel.SetTextMapPropagator still gets
// one trace from producer to consumer, and one that calls it, before or
// after building settle's pieces, gets its own choice.
func Propagator() propagation.TextMapPropagator {
	return &fallback{global: otel.GetTextMapPropagator()}
}

// fallback is the global propagator, or W3C while the global one has no
// fields. OTel's default global propagator delegates, once, to the first one
// the application sets, so once it has fields it keeps them.
type fallback struct {
	global propagation.TextMapPropagator
	set    atomic.Bool // global has fields
}

func (f *fallback) pick() propagation.TextMapPropagator {
	if f.set.Load() {
		return f.global
	}
	if len(f.global.Fields()) > 0 {
		f.set.Store(true)
		return f.global
	}
	return w3c
}

func (f *fallback) Inject(ctx context.Context, c propagation.TextMapCarrier) { f.pick().Inject(ctx, c) }

func (f *fallback) Extract(ctx context.Context, c propagation.TextMapCarrier) context.Context {
	return f.pick().Extract(ctx, c)
}

func (f *fallback) Fields() []string { return f.pick().Fields() }
