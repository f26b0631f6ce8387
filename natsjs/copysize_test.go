package natsjs_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// copyRig is a pipeline on the test's stream that poisons every message
// whose payload is over 1000 bytes or that carries an "x-poison" header, and
// parks through natsjs.NewPublisher, traced and metered into the rig.
type copyRig struct {
	env
	nc    *nats.Conn
	pub   message.Publisher
	spans *tracetest.SpanRecorder
	reads *sdkmetric.ManualReader
	runs  atomic.Int32
	seen  sync.Map // payload of each message the handler ran for -> true
}

func newCopyRig(t *testing.T, store settle.ParkStore) *copyRig {
	t.Helper()
	r := &copyRig{env: setup(t), spans: tracetest.NewSpanRecorder(), reads: sdkmetric.NewManualReader()}
	var err error
	if r.nc, err = nats.Connect(r.url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.nc.Close)
	if r.pub, err = natsjs.NewPublisher(natsjs.NewPublisherConfig(r.url), watermill.NopLogger{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.pub.Close() })
	sub := r.subscriber(t, natsjs.Config{Durable: "d", NakDelay: 100 * time.Millisecond})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(r.spans))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.reads))
	cfg := pipeline.Config{
		Publisher: r.pub,
		Store:     dedupe.NewMemoryStore(),
		ParkStore: store,
		NackDelay: 100 * time.Millisecond,
		Retry:     middleware.RetryConfig{MaxAttempts: 2, NoInProcessRetries: true},
		Tracing:   []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(mp)},
	}
	if store != nil {
		cfg.PoisonTopic = r.topic + ".poison"
	}
	p, err := pipeline.New(router, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Handle("h", r.topic, sub, func(m *message.Message) error {
		r.runs.Add(1)
		r.seen.Store(string(m.Payload), true)
		if len(m.Payload) > 1000 || m.Metadata.Get("x-poison") != "" {
			return poison.Permanent(errors.New("refused"))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

// poisonCopies reads every message the stream holds on the poison subject.
func (r *copyRig) poisonCopies(t *testing.T, want int) []*nats.Msg {
	t.Helper()
	waitUntil(t, "the poison copies", 20*time.Second, func() bool { return r.streamCount(t, r.topic+".poison") >= want })
	sub, err := r.js.SubscribeSync(r.topic+".poison", nats.DeliverAll(), nats.AckNone())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	var out []*nats.Msg
	for range want {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("poison copy %d of %d: %v", len(out)+1, want, err)
		}
		out = append(out, m)
	}
	if n := r.streamCount(t, r.topic+".poison"); n != want {
		t.Fatalf("%d poison copies; want %d", n, want)
	}
	return out
}

// deferred counts the deliveries whose span says they were deferred.
func (r *copyRig) deferred() int {
	n := 0
	for _, s := range r.spans.Ended() {
		for _, a := range s.Attributes() {
			if a.Key == "settle.outcome" && a.Value.AsString() == string(settle.Deferred) {
				n++
			}
		}
	}
	return n
}

// leftOutCount is the settle.park.payloads_left_out counter's total.
func (r *copyRig) leftOutCount(t *testing.T) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reads.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "settle.park.payloads_left_out" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				n += dp.Value
			}
		}
	}
	return n
}

// leftOutEvents counts the process spans with the settle.payload_left_out
// event.
func (r *copyRig) leftOutEvents() int {
	n := 0
	for _, s := range r.spans.Ended() {
		for _, e := range s.Events() {
			if e.Name == "settle.payload_left_out" && strings.HasPrefix(s.Name(), "process ") {
				n++
			}
		}
	}
	return n
}

// bigMessage publishes the largest message under max_payload the server
// takes (its payload only), then a small one behind it, and returns the
// big one's payload.
func (r *copyRig) bigMessage(t *testing.T) []byte {
	t.Helper()
	limit := int(r.nc.MaxPayload())
	var payload []byte
	for size := limit - 200; size > limit-4000; size -= 50 {
		m := message.NewMessage("big-"+watermill.NewShortUUID(), bytes.Repeat([]byte("x"), size))
		m.Metadata.Set("x-trace-me", "kept")
		if r.pub.Publish(r.topic, m) == nil {
			payload = m.Payload
			break
		}
	}
	if payload == nil {
		t.Fatalf("no payload near max_payload %d was accepted", limit)
	}
	t.Logf("max_payload %d, published a %d-byte payload", limit, len(payload))
	if err := r.pub.Publish(r.topic, message.NewMessage("small", []byte("ok"))); err != nil {
		t.Fatal(err)
	}
	return payload
}

// A message whose payload is near max_payload is poisoned: its copy cannot
// carry both the payload and settle's headers, so, with a parked-message
// store holding the whole message, it goes without the payload, on the
// first try, saying so (settle_payload_left_out, an error log, a span event
// and a metric), and the original is acked; the message behind it is
// handled. Without NewPublisher's limits the copy was refused ("maximum
// payload exceeded") on every delivery, for ever.
func TestNearMaxPayloadIsParkedWithoutPayload(t *testing.T) {
	r := newCopyRig(t, &memPark{})
	payload := r.bigMessage(t)
	cps := r.poisonCopies(t, 1)
	r.waitSettled(t, "d", 10*time.Second)
	if _, ok := r.seen.Load("ok"); !ok {
		t.Error("the small message behind the big one was not handled")
	}
	cp := cps[0]
	if len(cp.Data) != 0 {
		t.Errorf("the copy carries %d bytes of payload; want none", len(cp.Data))
	}
	var lo struct {
		Bytes  int    `json:"bytes"`
		SHA256 string `json:"sha256"`
	}
	if err := json.Unmarshal([]byte(cp.Header.Get(middleware.MetaPayloadLeftOut)), &lo); err != nil {
		t.Fatalf("%s = %q: %v", middleware.MetaPayloadLeftOut, cp.Header.Get(middleware.MetaPayloadLeftOut), err)
	}
	sum := sha256.Sum256(payload)
	if lo.Bytes != len(payload) || lo.SHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("%s says %d bytes, sha256 %s; want %d, %x", middleware.MetaPayloadLeftOut, lo.Bytes, lo.SHA256, len(payload), sum)
	}
	if got := cp.Header.Get(settle.MetaOutcome); got != string(settle.Poisoned) {
		t.Errorf("copy outcome %q; want poisoned", got)
	}
	if got := cp.Header.Get("x-trace-me"); got != "kept" {
		t.Errorf("copy's x-trace-me header %q; want the original's, kept", got)
	}
	if n := r.deferred(); n != 0 {
		t.Errorf("%d deliveries deferred; want the copy published the first time", n)
	}
	if n := r.leftOutEvents(); n != 1 {
		t.Errorf("%d settle.payload_left_out span events; want 1", n)
	}
	if n := r.leftOutCount(t); n != 1 {
		t.Errorf("settle.park.payloads_left_out = %d; want 1", n)
	}
}

// memPark is a parked-message store in memory.
type memPark struct {
	mu     sync.Mutex
	parked []settle.Parked
}

func (s *memPark) Park(_ context.Context, p settle.Parked) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.parked = append(s.parked, p)
	return nil
}

// With a parked-message store, the store holds the whole message whose copy
// goes without its payload.
func TestNearMaxPayloadIsKeptInTheParkStore(t *testing.T) {
	store := &memPark{}
	r := newCopyRig(t, store)
	payload := r.bigMessage(t)
	cps := r.poisonCopies(t, 1)
	r.waitSettled(t, "d", 10*time.Second)
	if len(cps[0].Data) != 0 || cps[0].Header.Get(middleware.MetaPayloadLeftOut) == "" {
		t.Errorf("the copy carries %d bytes of payload and %s %q; want none, and the header", len(cps[0].Data),
			middleware.MetaPayloadLeftOut, cps[0].Header.Get(middleware.MetaPayloadLeftOut))
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	if len(store.parked) != 1 || !bytes.Equal(store.parked[0].Message.Payload, payload) {
		t.Fatalf("the store holds %d messages; want the big one, whole", len(store.parked))
	}
}

// Originals with one header just under JetStream's 64k header block are
// poisoned: each copy is published the first time (measured as NATS
// encodes headers), leaving the header out and naming it in
// settle_dropped_headers; an original whose header fits beside settle's is
// copied with it intact. Before, a copy within settle's own 64 KiB count was
// over NATS's bound, deferred three times, then parked without any of the
// original's headers.
func TestCopyHeadersFitFirstTime(t *testing.T) {
	r := newCopyRig(t, nil)
	var sent int
	for size := 64600; size < 65500; size += 15 {
		m := message.NewMessage(watermill.NewShortUUID(), []byte("p"))
		m.Metadata.Set("x-poison", "1")
		m.Metadata.Set("x-big", strings.Repeat("a", size))
		if r.pub.Publish(r.topic, m) == nil {
			sent++
		}
	}
	if sent == 0 {
		t.Fatal("NATS accepted none of the originals")
	}
	fits := message.NewMessage("fits", []byte("fits"))
	fits.Metadata.Set("x-poison", "1")
	fits.Metadata.Set("x-big", strings.Repeat("b", 60000))
	fits.Metadata.Set("x-small", "s")
	if err := r.pub.Publish(r.topic, fits); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d originals near 64k accepted", sent)
	cps := r.poisonCopies(t, sent+1)
	r.waitSettled(t, "d", 10*time.Second)
	var dropped int
	for _, cp := range cps {
		if cp.Header.Get(settle.MetaOriginalUUID) == "fits" {
			if cp.Header.Get("x-big") != strings.Repeat("b", 60000) || cp.Header.Get("x-small") != "s" || cp.Header.Get(middleware.MetaDroppedHeaders) != "" {
				t.Errorf("the copy of the message whose headers fit has x-big of %d bytes, x-small %q, dropped %q; want both intact, none dropped",
					len(cp.Header.Get("x-big")), cp.Header.Get("x-small"), cp.Header.Get(middleware.MetaDroppedHeaders))
			}
			continue
		}
		if cp.Header.Get("x-big") == "" && strings.Contains(cp.Header.Get(middleware.MetaDroppedHeaders), `"x-big"`) && cp.Header.Get("x-poison") == "1" {
			dropped++
		}
	}
	if dropped != sent {
		t.Errorf("%d of %d copies left out x-big, named it and kept x-poison; want all", dropped, sent)
	}
	if n := r.deferred(); n != 0 {
		t.Errorf("%d deliveries deferred because their copy did not fit NATS's header block; want every copy publishable the first time", n)
	}
}

func waitUntil(t *testing.T, what string, within time.Duration, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A parking middleware built on watermill-nats' own Publisher, which says
// nothing of the server's bounds, logs an error naming natsjs.NewPublisher;
// one built on natsjs.NewPublisher's does not.
func TestParkingOnWatermillNATSPublisherLogsError(t *testing.T) {
	e := setup(t)
	for _, tc := range []struct {
		name string
		pub  message.Publisher
		want bool
	}{
		{"watermill-nats", func() message.Publisher {
			p, err := wmnats.NewPublisher(natsjs.NewPublisherConfig(e.url), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			return p
		}(), true},
		{"natsjs", func() message.Publisher {
			p, err := natsjs.NewPublisher(natsjs.NewPublisherConfig(e.url), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			return p
		}(), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := watermill.NewCaptureLogger()
			if _, err := middleware.NewPoison(middleware.ParkConfig{Publisher: tc.pub, Topic: e.topic + ".poison", Logger: log}); err != nil {
				t.Fatal(err)
			}
			var got bool
			for _, m := range log.Captured()[watermill.ErrorLogLevel] {
				got = got || strings.Contains(m.Err.Error(), "natsjs.NewPublisher")
			}
			if got != tc.want {
				t.Errorf("error naming natsjs.NewPublisher logged: %v; want %v", got, tc.want)
			}
		})
	}
}

// Without a parked-message store nothing but the stream would hold the
// payload of a message too large to copy: no copy goes, the original is
// not acked but deferred, and comes back; the message behind it is
// handled. (A copy without the payload, acked, lost the payload.)
func TestNearMaxPayloadWithoutStoreStaysOnItsStream(t *testing.T) {
	r := newCopyRig(t, nil)
	payload := r.bigMessage(t)
	// A redelivery of a message that could not be parked parks it again
	// without running the handler: count the deferred settlements.
	waitUntil(t, "the small message handled and the big one deferred three times", 20*time.Second, func() bool {
		_, ok := r.seen.Load("ok")
		return ok && r.deferred() >= 3
	})
	if n := r.streamCount(t, r.topic+".poison"); n != 0 {
		t.Fatalf("%d poison copies; want none without a store", n)
	}
	if n := r.leftOutCount(t); n != 0 {
		t.Errorf("settle.park.payloads_left_out = %d; want 0: nothing was parked", n)
	}
	if _, ok := r.seen.Load(string(payload)); !ok {
		t.Error("the big message never reached the handler")
	}
}
