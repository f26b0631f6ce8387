package settle

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
)

// Settlement is the record of how one delivery is settling. The outermost
// middleware (settle's tracing) puts one in the message's context; the inner
// middleware fill it in as they decide. Middleware that finds none in the
// context simply records nothing.
type Settlement struct {
	// Propagator writes trace context into messages settle publishes while
	// settling (dead-letter and poison copies). Set by the tracing
	// middleware; nil means none.
	Propagator propagation.TextMapPropagator
	// SpanAttributes identify the delivery on every span settle starts while
	// settling it (messaging.system, settle.handler). Set by the tracing
	// middleware; nil means none.
	SpanAttributes []attribute.KeyValue

	mu       sync.Mutex
	outcome  Outcome
	retries  int
	parkedTo string
	reason   error
}

type settlementKey struct{}

// WithSettlement returns a context carrying a new, empty Settlement.
func WithSettlement(ctx context.Context, p propagation.TextMapPropagator) (context.Context, *Settlement) {
	s := &Settlement{Propagator: p}
	return context.WithValue(ctx, settlementKey{}, s), s
}

// SettlementFromContext returns the context's Settlement, or nil.
func SettlementFromContext(ctx context.Context) *Settlement {
	s, _ := ctx.Value(settlementKey{}).(*Settlement)
	return s
}

// SetOutcome records the outcome decided so far; a later call overrides an
// earlier one, since outer middleware decide last. Nil-safe.
func (s *Settlement) SetOutcome(o Outcome) {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.outcome = o
	s.mu.Unlock()
}

// Parked records that a copy was stored on topic with outcome o (dead-letter
// or poison) because of reason. Nil-safe.
func (s *Settlement) Parked(o Outcome, topic string, reason error) {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.outcome, s.parkedTo, s.reason = o, topic, reason
	s.mu.Unlock()
}

// Retried counts one in-process retry. Nil-safe.
func (s *Settlement) Retried() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.retries++
	s.mu.Unlock()
}

// Outcome returns the recorded outcome ("" if none), the number of
// in-process retries, and the topic a copy was parked on with the failure
// that sent it there.
func (s *Settlement) Outcome() (o Outcome, retries int, parkedTo string, reason error) {
	if s == nil {
		return "", 0, "", nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.outcome, s.retries, s.parkedTo, s.reason
}
