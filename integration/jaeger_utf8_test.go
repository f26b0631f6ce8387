package integration_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// One message whose ID and error text are not valid UTF-8, among 40 good
// ones, exported through otlptracehttp to a real Jaeger: every message's
// process span is stored, the bad one's ID and error cleaned. Before settle
// cleaned them, the exporter could not encode the request and Jaeger
// received none of the batch. (Not parallel: Jaeger's ports are fixed.)
func TestInvalidUTF8MessageKeepsItsBatchInJaeger(t *testing.T) {
	startJaeger(t)
	service := testenv.Name(t, "utf8")
	exp, err := otlptracehttp.New(t.Context(), otlptracehttp.WithEndpoint("127.0.0.1:4318"), otlptracehttp.WithInsecure(),
		otlptracehttp.WithRetry(otlptracehttp.RetryConfig{Enabled: false}))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Hour)),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", service))))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tracing, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMessagingSystem("gochannel"))
	if err != nil {
		t.Fatal(err)
	}

	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	poisoned, err := ps.Subscribe(t.Context(), "signups.poison")
	if err != nil {
		t.Fatal(err)
	}
	parking, err := middleware.NewPoison(middleware.ParkConfig{Publisher: ps, Topic: "signups.poison"})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	bad := "signup-\xff\xfe-" + strings.Repeat("z", 600)
	handled := make(chan string, 64)
	router.AddConsumerHandler("welcome", "signups", ps, func(m *message.Message) error {
		handled <- m.UUID
		if m.UUID == bad {
			return poison.Permanent(fmt.Errorf("no such user %s", m.Payload))
		}
		return nil
	}).AddMiddleware(tracing, parking)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		_ = router.Close()
		<-done
		_ = ps.Close()
	})

	var ids []string
	for i := range 40 {
		ids = append(ids, fmt.Sprintf("signup-%02d", i))
		if i == 20 {
			ids = append(ids, bad)
		}
	}
	for _, id := range ids {
		payload := []byte("{}")
		if id == bad {
			payload = []byte("\xc3\x28 " + strings.Repeat("p", 4000))
		}
		if err := ps.Publish("signups", message.NewMessage(id, payload)); err != nil {
			t.Fatal(err)
		}
	}
	for range ids {
		select {
		case <-handled:
		case <-time.After(30 * time.Second):
			t.Fatal("not every message was handled")
		}
	}
	select {
	case m := <-poisoned:
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the bad message was not parked")
	}

	var flushErr error
	var procs []jaegerSpan
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := tp.ForceFlush(t.Context()); err != nil {
			flushErr = err
		}
		procs = procs[:0]
		for _, tr := range jaegerTraces(t, service) {
			procs = append(procs, tr.find("process signups", "")...)
		}
		if len(procs) >= len(ids) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Jaeger stored %d process spans of %s, want %d: one bad message lost its batch (exporter: %v)",
				len(procs), service, len(ids), flushErr)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var cleaned jaegerSpan
	for _, sp := range procs {
		if id := sp.tag("messaging.message.id"); strings.HasPrefix(id, "signup-\uFFFD-zzz") {
			cleaned = sp
		}
	}
	if cleaned.SpanID == "" {
		t.Fatal("no process span with the bad message's ID cleaned")
	}
	id := cleaned.tag("messaging.message.id")
	if len(id) > 256 || !utf8.ValidString(id) {
		t.Errorf("the bad message's ID is %d bytes, valid UTF-8 %v", len(id), utf8.ValidString(id))
	}
	if cleaned.tag("settle.outcome") != "poisoned" {
		t.Errorf("the bad message's outcome %q", cleaned.tag("settle.outcome"))
	}
	var exception string
	for _, l := range cleaned.Logs {
		for _, f := range l.Fields {
			if f.Key == "exception.message" {
				exception = fmt.Sprint(f.Value)
			}
		}
	}
	if !strings.HasPrefix(exception, "permanent: no such user \uFFFD(") || len(exception) > 2048 {
		t.Errorf("the bad message's exception (%d bytes): %.60q", len(exception), exception)
	}
}
