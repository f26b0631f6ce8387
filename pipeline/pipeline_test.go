package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
)

type order struct {
	ID    string `json:"id"`
	Cents int    `json:"cents"`
}

func fastRetry() middleware.RetryConfig {
	return middleware.RetryConfig{MaxAttempts: 3, InProcessRetries: 1, InitialInterval: time.Millisecond,
		MaxInterval: 2 * time.Millisecond, RedeliveryDelay: time.Millisecond}
}

type harness struct {
	pubsub *gochannel.GoChannel
	router *message.Router
	p      *pipeline.Pipeline
	spans  *tracetest.SpanRecorder
}

func newHarness(t *testing.T, store dedupe.Store) *harness {
	t.Helper()
	return newHarnessWith(t, store, nil)
}

// newHarnessWith is newHarness with a change to the pipeline's config.
func newHarnessWith(t *testing.T, store dedupe.Store, change func(*pipeline.Config)) *harness {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	must(t, err)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	cfg := pipeline.Config{
		Publisher: ps, Store: store, Retry: fastRetry(),
		Tracing: []settle.Option{settle.WithTracerProvider(tp)},
	}
	if change != nil {
		change(&cfg)
	}
	p, err := pipeline.New(router, cfg)
	must(t, err)
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &harness{pubsub: ps, router: router, p: p, spans: rec}
}

func (h *harness) run(t *testing.T) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- h.router.Run(context.Background()) }()
	<-h.router.Running()
	t.Cleanup(func() {
		must(t, h.router.Close())
		must(t, <-done)
		must(t, h.pubsub.Close())
	})
}

func (h *harness) collect(t *testing.T, topic string) func() []*message.Message {
	t.Helper()
	msgs, err := h.pubsub.Subscribe(t.Context(), topic)
	must(t, err)
	var mu sync.Mutex
	var got []*message.Message
	go func() {
		for m := range msgs {
			mu.Lock()
			got = append(got, m)
			mu.Unlock()
			m.Ack()
		}
	}()
	return func() []*message.Message {
		mu.Lock()
		defer mu.Unlock()
		return append([]*message.Message(nil), got...)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// The assembled stack settles each kind of message its own way.
func TestPipelineSettlesEachOutcome(t *testing.T) {
	t.Parallel()
	h := newHarness(t, dedupe.NewMemoryStore())
	var mu sync.Mutex
	charged := map[string]int{}
	var flaky atomic.Int64
	_, err := h.p.Handle("charge", "orders", h.pubsub, pipeline.Typed(nil, func(ctx context.Context, m pipeline.Message[order]) error {
		switch m.Body.ID {
		case "always-fails":
			return errors.New("payment provider down")
		case "flaky":
			if flaky.Add(1) == 1 {
				return errors.New("timeout")
			}
		}
		mu.Lock()
		charged[m.Body.ID]++
		mu.Unlock()
		return nil
	}))
	must(t, err)
	dead := h.collect(t, "orders.dead_letter")
	poisoned := h.collect(t, "orders.poison")
	h.run(t)

	publish := func(uuid, payload string) {
		must(t, h.pubsub.Publish("orders", message.NewMessage(uuid, []byte(payload))))
	}
	publish("m1", `{"id":"A-1","cents":100}`)
	publish("m1", `{"id":"A-1","cents":100}`) // redelivered
	publish("m2", `{"id":"flaky","cents":100}`)
	publish("m3", `{"id":"always-fails","cents":100}`)
	publish("m4", `{"id": 17}`) // wrong type: poison
	publish("m5", `not json`)   // poison

	waitFor(t, "settlements", func() bool {
		processed := 0 // deliveries whose process span ended: seven, m2 twice
		for _, s := range h.spans.Ended() {
			if s.Name() == "process orders" {
				processed++
			}
		}
		return len(dead()) == 1 && len(poisoned()) == 2 && processed >= 7
	})
	mu.Lock()
	defer mu.Unlock()
	if charged["A-1"] != 1 || charged["flaky"] != 1 || charged["always-fails"] != 0 {
		t.Fatalf("charged = %v; want A-1 and flaky once each", charged)
	}
	if d := dead()[0]; d.UUID != "m3" || d.Metadata.Get(settle.MetaAttempt) != "3" {
		t.Fatalf("dead-letter %s attempt %s; want m3 after 3", d.UUID, d.Metadata.Get(settle.MetaAttempt))
	}
	for _, p := range poisoned() {
		if !strings.Contains(p.Metadata.Get(settle.MetaReason), "pipeline_test.order") {
			t.Fatalf("poison reason %q does not name the type", p.Metadata.Get(settle.MetaReason))
		}
	}
	outcomes := map[string]int{}
	for _, s := range h.spans.Ended() {
		if s.Name() == "process orders" {
			for _, kv := range s.Attributes() {
				if kv.Key == attribute.Key("settle.outcome") {
					outcomes[kv.Value.AsString()]++
				}
			}
		}
	}
	if outcomes["duplicate"] != 1 || outcomes["dead_lettered"] != 1 || outcomes["poisoned"] != 2 || outcomes["done"] != 2 {
		t.Fatalf("outcomes = %v", outcomes)
	}
}

func TestPipelineProducingAndTx(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	e := newTxEnv(t, stdOf(db))
	h := newHarness(t, e.store)
	_, err := h.p.HandleProducing("ship", "orders", h.pubsub, "shipments", func(msg *message.Message) ([]*message.Message, error) {
		m, err := pipeline.Decode[order](nil, msg)
		if err != nil {
			return nil, err
		}
		out, err := pipeline.NewMessage("ship-"+m.UUID, nil, m.Body)
		return []*message.Message{out}, err
	})
	must(t, err)
	_, err = pipeline.HandleTx(h.p, "charge", "payments", h.pubsub, pipeline.TxConfig[*sql.Tx]{DB: std(db), Outbox: e.ob},
		pipeline.TypedTx(nil, func(ctx context.Context, tx *sql.Tx, m pipeline.Message[order], out message.Publisher) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES (?, ?)", m.Body.ID, m.Body.Cents)
			return err
		}))
	must(t, err)
	shipments := h.collect(t, "shipments")
	h.run(t)
	for range 2 {
		must(t, h.pubsub.Publish("orders", message.NewMessage("o-1", []byte(`{"id":"A-1","cents":5}`))))
		must(t, h.pubsub.Publish("payments", message.NewMessage("p-1", []byte(`{"id":"A-1","cents":5}`))))
	}
	// All four deliveries settled (their process spans, which record it, ended), then count effects.
	waitFor(t, "four acked deliveries", func() bool {
		n := 0
		for _, s := range h.spans.Ended() {
			if settledAs(s) == "ack" {
				n++
			}
		}
		return n == 4
	})
	// The shipment reaches its subscriber after the router acked o-1.
	waitFor(t, "a shipment", func() bool { return len(shipments()) > 0 })
	if len(shipments()) != 1 || e.rows(t) != 1 {
		t.Fatalf("shipments=%d charges=%d; want one each for two deliveries", len(shipments()), e.rows(t))
	}
}

func TestPipelineRefusesBadConfig(t *testing.T) {
	t.Parallel()
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	must(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer ps.Close()
	cases := []struct {
		cfg   pipeline.Config
		field string
	}{
		{pipeline.Config{}, "Config.Publisher"},
		{pipeline.Config{Publisher: ps, Retry: middleware.RetryConfig{MaxAttempts: -1}}, "RetryConfig.MaxAttempts"},
		{pipeline.Config{Publisher: ps, Store: dedupe.NewMemoryStore(), ClaimTimeout: time.Millisecond}, "Config.ClaimTimeout"},
	}
	for _, c := range cases {
		if _, err := pipeline.New(router, c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("New(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: dedupe.NewMemoryStore()})
	must(t, err)
	if _, err := pipeline.HandleTx(p, "x", "t", ps, pipeline.TxConfig[*sql.Tx]{}, nil); err == nil {
		t.Fatal("HandleTx with a memory store succeeded")
	}
}

func TestConcurrencyNeedsCompetingConsumers(t *testing.T) {
	t.Parallel()
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	must(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer ps.Close()
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Concurrency: -1}); err == nil || !strings.Contains(err.Error(), "Config.Concurrency") {
		t.Fatalf("negative concurrency: %v", err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Concurrency: 4})
	must(t, err)
	if _, err := p.Handle("h", "t", ps, func(*message.Message) error { return nil }); err == nil || !strings.Contains(err.Error(), "GoChannel") {
		t.Fatalf("Concurrency 4 on GoChannel: %v; want it refused", err)
	}
}
