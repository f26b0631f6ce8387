package middleware_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/otlptest"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// A message whose ID and error text are not valid UTF-8 (and are long) must
// not cost the spans of the other messages exported with it: OTLP is
// protobuf, and a string field that is not valid UTF-8 makes the exporter
// refuse the whole request. The spans go through otlptracehttp to a real
// OTLP/HTTP endpoint that decodes them; every good message's spans arrive,
// and the bad ones arrive cleaned and bounded.
func TestTracingInvalidUTF8ReachesOTLP(t *testing.T) {
	t.Parallel()
	recv := otlptest.New(t)
	tp := recv.TracerProvider(t)
	mw, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMessagingSystem("gochannel"))
	must(t, err)

	long := strings.Repeat("x", 5000)
	poisonID := "order-\xff\xfe-" + long                // invalid UTF-8, and longer than any ID should be
	deadID := "order-\xc3\x28-dead"                     // an invalid two-byte sequence
	payload := "customer \xe2\x28\xa1 " + long + "\xff" // what a handler puts into its error text
	s := newStack(t, stackOpts{retry: fastRetry(1, 0), outer: mw, noDedupe: true}, func(m *message.Message) error {
		switch m.UUID {
		case poisonID:
			return poison.Permanent(fmt.Errorf("cannot charge %s", m.Payload))
		case deadID:
			return errors.New("smtp: 450 mailbox " + string(m.Payload) + " unavailable")
		}
		return nil
	})

	const good = 39
	var goodIDs []string
	for i := range good {
		goodIDs = append(goodIDs, fmt.Sprintf("order-%03d", i))
	}
	// The bad ones in the middle, so that the spans of good messages end on
	// both sides of theirs in the one batch the exporter sends.
	for _, id := range goodIDs[:good/2] {
		s.publish(message.NewMessage(id, []byte("{}")))
	}
	s.publish(message.NewMessage(poisonID, []byte(payload)), message.NewMessage(deadID, []byte(payload)))
	for _, id := range goodIDs[good/2:] {
		s.publish(message.NewMessage(id, []byte("{}")))
	}
	s.waitAcked(good + 2)
	eventually(t, 10*time.Second, "both parked copies", func() bool { _, d, p := s.snapshot(); return len(d) == 1 && len(p) == 1 })

	// Every delivery has a process span, which tells its ack; the two
	// parked ones a send span too.
	const want = (good + 2) + 2
	var flushErr error // what the exporter said, for the failure message
	deadline := time.Now().Add(30 * time.Second)
	for len(recv.Spans()) < want && time.Now().Before(deadline) {
		if err := tp.ForceFlush(t.Context()); err != nil {
			flushErr = err
		}
		time.Sleep(20 * time.Millisecond)
	}
	spans := recv.Spans()
	if errs := recv.Errors(); len(errs) > 0 {
		t.Fatalf("the OTLP endpoint could not decode %d requests: %v", len(errs), errs)
	}
	if len(spans) < want {
		t.Fatalf("the OTLP endpoint received %d spans in %d requests, want %d: one bad message lost the spans exported with it (exporter: %v)",
			len(spans), recv.Requests(), want, flushErr)
	}

	byID := map[string][]*tracepb.Span{}
	for _, sp := range spans {
		if len(sp.GetName()) > 300 {
			t.Errorf("span name of %d bytes", len(sp.GetName()))
		}
		for _, kv := range sp.GetAttributes() {
			if v := kv.GetValue().GetStringValue(); len(v) > 2048 || !utf8.ValidString(v) {
				t.Errorf("span %q: attribute %s is %d bytes, valid UTF-8 %v", sp.GetName(), kv.GetKey(), len(v), utf8.ValidString(v))
			}
		}
		for _, e := range sp.GetEvents() {
			for _, kv := range e.GetAttributes() {
				if v := kv.GetValue().GetStringValue(); len(v) > 2048 {
					t.Errorf("span %q event %s: attribute %s is %d bytes", sp.GetName(), e.GetName(), kv.GetKey(), len(v))
				}
			}
		}
		if d := sp.GetStatus().GetMessage(); len(d) > 2048 {
			t.Errorf("span %q: status description of %d bytes", sp.GetName(), len(d))
		}
		if id, ok := otlptest.Attr(sp, "messaging.message.id"); ok && sp.GetName() == "process "+topic {
			byID[id] = append(byID[id], sp)
		}
	}
	for _, id := range goodIDs {
		if len(byID[id]) != 1 {
			t.Errorf("message %s: %d process spans received, want 1", id, len(byID[id]))
		}
	}

	// The bad IDs arrive cleaned: what was valid kept, the rest replaced,
	// the length bounded.
	var poisoned, dead *tracepb.Span
	for id, ss := range byID {
		switch {
		case strings.HasPrefix(id, "order-\uFFFD-xxx"):
			poisoned = ss[0]
			if len(id) > 256 || !strings.HasSuffix(id, "…") {
				t.Errorf("the poisoned message's ID is %d bytes, cut %v; want at most 256, ending in …", len(id), strings.HasSuffix(id, "…"))
			}
		case id == "order-\uFFFD(-dead":
			dead = ss[0]
		}
	}
	if poisoned == nil || dead == nil {
		t.Fatalf("the process spans of the bad messages were not received cleaned (poisoned %v, dead-lettered %v)", poisoned != nil, dead != nil)
	}
	if o, _ := otlptest.Attr(poisoned, "settle.outcome"); o != "poisoned" {
		t.Errorf("poisoned message's outcome %q", o)
	}
	if d := poisoned.GetStatus().GetMessage(); !strings.HasPrefix(d, "permanent: cannot charge customer \uFFFD(\uFFFD xxx") {
		t.Errorf("poisoned message's status description %.60q...", d)
	}
	if m, ok := otlptest.EventAttr(poisoned, "exception", "exception.message"); !ok || !strings.HasPrefix(m, "permanent: cannot charge customer \uFFFD") {
		t.Errorf("poisoned message's exception event: %v %.60q", ok, m)
	}
	if m, ok := otlptest.EventAttr(dead, "settle.attempt_failed", "exception.message"); !ok || !strings.HasPrefix(m, "smtp: 450 mailbox customer \uFFFD") {
		t.Errorf("dead-lettered message's attempt_failed event: %v %.60q", ok, m)
	}
}
