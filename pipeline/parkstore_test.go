package pipeline_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// parkedTable creates a parked-message store whose tables have a unique
// name on d, and drops them when the test ends.
func parkedTable[TTx any](t testing.TB, d db[TTx]) (*parked.Store[TTx], string) {
	t.Helper()
	name := testenv.Name(t, "pk")
	table := "pk_" + name[len(name)-8:] // room for the store's "_groups"
	st, err := parked.New(d.Driver, parked.Config{Table: table})
	must(t, err)
	for _, s := range st.Schema() {
		d.exec(t, s)
	}
	t.Cleanup(func() {
		// The group counts and the rows, in either order of their
		// dependency.
		for _, tbl := range []string{table + "_groups", table, table + "_off", table + "_groups"} {
			_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+d.quote(tbl))
		}
	})
	return st, table
}

// attemptsOf returns the attempts of each row.
func attemptsOf(rows []parked.Message) []int {
	a := make([]int, len(rows))
	for i, r := range rows {
		a[i] = r.Attempts
	}
	return a
}

// waitLong is waitFor with 30 seconds: the messages here carry 512 KiB of
// metadata to the database at each Park.
func waitLong(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not reached in 30s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// parkedRows returns the rows f selects, whole (List leaves out the
// payloads and metadata; Get has them).
func parkedRows[TTx any](t testing.TB, st *parked.Store[TTx], f parked.Filter) []parked.Message {
	t.Helper()
	page, err := st.List(context.Background(), parked.Query{Filter: f, Limit: 1000})
	must(t, err)
	rows := page.Messages
	for i, r := range rows {
		rows[i], err = st.Get(context.Background(), r.ID)
		must(t, err)
	}
	return rows
}

// countingStore counts the Park calls that reached a store and those that
// failed.
type countingStore struct {
	settle.ParkStore
	calls, failed atomic.Int64
}

func (s *countingStore) Park(ctx context.Context, p settle.Parked) error {
	s.calls.Add(1)
	err := s.ParkStore.Park(ctx, p)
	if err != nil {
		s.failed.Add(1)
	}
	return err
}

// Hostile parts of the parked messages: a metadata value of 512 KiB (a
// topic copy leaves it out: it is over ParkConfig.MaxMetadataBytes), one of
// invalid UTF-8 with a NUL byte, markup, and a payload that is neither
// text nor JSON.
var (
	bigValue     = strings.Repeat("0123456789abcdef", 512<<10/16)
	binaryValue  = "\xff\xfe\x00<script>alert(1)</script>\xc3"
	hostileBytes = []byte("\x00\xff{\"not\": json\xfe")
)

// failingOrder is a message the handler fails: fate "poison" with a
// permanent error, fate "dead" with an error every time. Its dedupe key is
// "order:" + id (the pipeline's Key), and it belongs to the trace traceID.
func failingOrder(fate, id, traceID string) *message.Message {
	m := message.NewMessage(fate+"-"+id+"-"+watermill.NewShortUUID(), hostileBytes)
	m.Metadata.Set("fate", fate)
	m.Metadata.Set("order_id", id)
	m.Metadata.Set("big", bigValue)
	m.Metadata.Set("binary", binaryValue)
	m.Metadata.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	return m
}

// fail is what the handler returns for a failing order.
func fail(msg *message.Message) error {
	if msg.Metadata.Get("fate") == "poison" {
		return poison.Permanent(fmt.Errorf("order %s refused: card 4242 expired", msg.Metadata.Get("order_id")))
	}
	return fmt.Errorf("payment gateway timeout after 30s for order %s", msg.Metadata.Get("order_id"))
}

// parkHarness is one assembly of the stack with a parked-message store, on
// a GoChannel broker, with its runs counted.
type parkHarness struct {
	ps     *gochannel.GoChannel
	router *message.Router
	runs   runCounter
	copies func() []*message.Message // on the dead-letter topic, when one is set
}

func (h *parkHarness) run(t *testing.T) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- h.router.Run(context.Background()) }()
	<-h.router.Running()
	t.Cleanup(func() {
		must(t, h.router.Close())
		must(t, <-done)
		must(t, h.ps.Close())
	})
}

// inFlightSub is a GoChannel subscriber that says it hands its router 2
// deliveries at once, so that a batch handler is accepted on it.
type inFlightSub struct{ *gochannel.GoChannel }

func (inFlightSub) InFlight() int { return 2 }

// parkAssembly names a way to build the stack.
type parkAssembly string

const (
	byPipelineHandle parkAssembly = "pipeline.Handle"
	byPipelineTopics parkAssembly = "pipeline.Handle+topics" // the store beside the parking topics
	byHandleTx       parkAssembly = "pipeline.HandleTx"
	byHandleBatchTx  parkAssembly = "pipeline.HandleBatchTx"
	byHandBuilt      parkAssembly = "hand-built"
)

const (
	parkHandler = "charge"
	parkTopic   = "orders"
	deadCopies  = "orders.dead_letter"
)

// newParkHarness builds the stack as a says, with store as the parked
// store and a claims table on d, for a handler named parkHandler on
// parkTopic that fails every message (see fail).
func newParkHarness[TTx any](t *testing.T, d db[TTx], a parkAssembly, store settle.ParkStore) *parkHarness {
	t.Helper()
	h := &parkHarness{ps: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	h.router = router
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tracing := []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})}
	claims := claimsTable(t, d)
	key := dedupe.MetadataKey("order_id", "order:")
	if a == byHandBuilt {
		tr, err := middleware.NewTracing(tracing...)
		must(t, err)
		park := middleware.ParkConfig{Store: store, NackDelay: time.Millisecond}
		ps1, err := middleware.NewPoison(park)
		must(t, err)
		dl, err := middleware.NewDeadLetter(park)
		must(t, err)
		retry := fastRetry()
		retry.StoreCounts = true
		rt, err := middleware.NewRetry(retry)
		must(t, err)
		dd, err := dedupe.NewMiddleware(dedupe.Config{Store: claims, Key: key, BusyDelay: time.Millisecond, UnavailableDelay: time.Millisecond})
		must(t, err)
		router.AddConsumerHandler(parkHandler, parkTopic, h.ps, func(msg *message.Message) error {
			h.runs.add(parkHandler, msg.UUID)
			return fail(msg)
		}).AddMiddleware(tr, ps1, dl, rt, dd)
		return h
	}
	cfg := pipeline.Config{Publisher: h.ps, Store: claims, Key: key, ParkStore: store, Retry: fastRetry(),
		NackDelay: time.Millisecond, BusyDelay: time.Millisecond, UnavailableDelay: time.Millisecond, Tracing: tracing}
	if a == byPipelineTopics {
		cfg.DeadLetterTopic, cfg.PoisonTopic = deadCopies, deadCopies
		msgs, err := h.ps.Subscribe(t.Context(), deadCopies)
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
		h.copies = func() []*message.Message {
			mu.Lock()
			defer mu.Unlock()
			return append([]*message.Message(nil), got...)
		}
	}
	p, err := pipeline.New(router, cfg)
	must(t, err)
	switch a {
	case byPipelineHandle, byPipelineTopics:
		_, err = p.Handle(parkHandler, parkTopic, h.ps, func(msg *message.Message) error {
			h.runs.add(parkHandler, msg.UUID)
			return fail(msg)
		})
	case byHandleTx:
		_, err = pipeline.HandleTx(p, parkHandler, parkTopic, h.ps, pipeline.TxConfig[TTx]{DB: d.Driver},
			func(_ context.Context, _ TTx, msg *message.Message, _ message.Publisher) error {
				h.runs.add(parkHandler, msg.UUID)
				return fail(msg)
			})
	case byHandleBatchTx:
		_, err = pipeline.HandleBatchTx(p, parkHandler, parkTopic, inFlightSub{h.ps}, pipeline.TxConfig[TTx]{DB: d.Driver,
			Batch: pipeline.BatchConfig{MaxSize: 2, MaxWait: time.Millisecond}},
			func(_ context.Context, _ TTx, msgs []*message.Message, _ message.Publisher) error {
				for i, msg := range msgs {
					h.runs.add(parkHandler, msg.UUID)
					if err := fail(msg); err != nil {
						return pipeline.MessageFailed(i, err)
					}
				}
				return nil
			})
	}
	must(t, err)
	return h
}

// Each dead-lettered and each poisoned message is one row of the store,
// with everything the middleware knows of it, and the message whole: the
// 512 KiB metadata value a topic copy leaves out, the invalid UTF-8 and the
// binary payload byte for byte. On every database and driver, and through
// each way of assembling the stack.
func TestParkedStoreRecordsEachParkedMessage(t *testing.T) {
	t.Parallel()
	onEachDriver(t, recordsEachParkedMessage[*sql.Tx], recordsEachParkedMessage[pgx.Tx])
}

func recordsEachParkedMessage[TTx any](t *testing.T, d db[TTx]) {
	for _, a := range []parkAssembly{byPipelineHandle, byPipelineTopics, byHandleTx, byHandleBatchTx, byHandBuilt} {
		t.Run(string(a), func(t *testing.T) {
			st, _ := parkedTable(t, d)
			h := newParkHarness(t, d, a, st)
			h.run(t)
			start := time.Now()
			dead := failingOrder("dead", "17", "4bf92f3577b34da6a3ce929d0e0e4736")
			pois := failingOrder("poison", "18", "5bf92f3577b34da6a3ce929d0e0e4737")
			must(t, h.ps.Publish(parkTopic, dead, pois))
			waitLong(t, "two parked rows", func() bool { return len(parkedRows(t, st, parked.Filter{})) >= 2 })
			for _, c := range []struct {
				msg      *message.Message
				outcome  settle.Outcome
				attempts int
				key      string
				traceID  string
				reason   string
			}{
				{dead, settle.DeadLettered, 3, "order:17", "4bf92f3577b34da6a3ce929d0e0e4736", "payment gateway timeout after 30s for order 17"},
				{pois, settle.Poisoned, 1, "order:18", "5bf92f3577b34da6a3ce929d0e0e4737", "order 18 refused: card 4242 expired"},
			} {
				rows := parkedRows(t, st, parked.Filter{UUID: c.msg.UUID})
				if len(rows) != 1 {
					t.Fatalf("%s: %d rows; want 1", c.outcome, len(rows))
				}
				r := rows[0]
				if r.Outcome != c.outcome || r.Handler != parkHandler || r.Topic != parkTopic || r.UUID != c.msg.UUID ||
					r.Key != c.key || r.Attempts != c.attempts || r.TraceID != c.traceID || r.State != parked.StateParked {
					t.Errorf("%s row: outcome %q handler %q topic %q uuid %q key %q attempts %d trace %q state %q; want %q %q %q %q %q %d %q parked",
						c.outcome, r.Outcome, r.Handler, r.Topic, r.UUID, r.Key, r.Attempts, r.TraceID, r.State,
						c.outcome, parkHandler, parkTopic, c.msg.UUID, c.key, c.attempts, c.traceID)
				}
				if !strings.Contains(r.Reason, c.reason) {
					t.Errorf("%s row: reason %q; want it to say %q", c.outcome, r.Reason, c.reason)
				}
				// Databases keep times to the microsecond (MariaDB, as
				// configured, maybe to the second).
				lo, hi := start.Add(-time.Second), time.Now().Add(time.Second)
				if r.FirstFailure.Before(lo) || r.LastFailure.After(hi) || r.FirstFailure.After(r.LastFailure) {
					t.Errorf("%s row: first failure %v, last %v; want %v <= first <= last <= %v", c.outcome, r.FirstFailure, r.LastFailure, lo, hi)
				}
				if !bytes.Equal(r.Payload, hostileBytes) {
					t.Errorf("%s row: payload %q; want %q", c.outcome, r.Payload, hostileBytes)
				}
				for _, k := range []string{"big", "binary", "order_id", "fate"} {
					if got, want := r.Metadata.Get(k), c.msg.Metadata.Get(k); got != want {
						t.Errorf("%s row: metadata %q is %d bytes %.40q; want %d bytes %.40q", c.outcome, k, len(got), got, len(want), want)
					}
				}
				if n := h.runs.get(parkHandler, c.msg.UUID); n != c.attempts {
					t.Errorf("%s: handler ran %d times; want %d", c.outcome, n, c.attempts)
				}
			}
			if h.copies != nil {
				// Beside the store, each has its copy on the topic, bounded:
				// the big value is left out there and only there.
				waitLong(t, "two copies", func() bool { return len(h.copies()) >= 2 })
				for _, cp := range h.copies() {
					if cp.Metadata.Get("big") != "" || !strings.Contains(cp.Metadata.Get(middleware.MetaDroppedHeaders), `"big"`) {
						t.Errorf("copy %s carries the 512 KiB value, or does not say it dropped it: %q", cp.UUID, cp.Metadata.Get(middleware.MetaDroppedHeaders))
					}
				}
			}
			time.Sleep(50 * time.Millisecond) // a second row would come now
			if n := len(parkedRows(t, st, parked.Filter{})); n != 2 {
				t.Fatalf("%d rows; want 2", n)
			}
		})
	}
}

// Two handlers of one topic that both fail the same message each park it:
// two rows, one per handler, however often it comes.
func TestParkedStoreKeepsARowPerHandler(t *testing.T) {
	t.Parallel()
	onEachDriver(t, rowPerHandler[*sql.Tx], rowPerHandler[pgx.Tx])
}

func rowPerHandler[TTx any](t *testing.T, d db[TTx]) {
	st, _ := parkedTable(t, d)
	h := &parkHarness{ps: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	h.router = router
	p, err := pipeline.New(router, pipeline.Config{Publisher: h.ps, Store: claimsTable(t, d), ParkStore: st, Retry: fastRetry(),
		NackDelay: time.Millisecond, DisableTracing: true})
	must(t, err)
	for _, name := range []string{"charge", "ship"} {
		_, err := p.Handle(name, parkTopic, h.ps, func(msg *message.Message) error {
			h.runs.add(name, msg.UUID)
			return fail(msg)
		})
		must(t, err)
	}
	h.run(t)
	msg := failingOrder("poison", "19", "6bf92f3577b34da6a3ce929d0e0e4738")
	must(t, h.ps.Publish(parkTopic, msg))
	must(t, h.ps.Publish(parkTopic, msg.Copy())) // the same message, delivered again
	waitLong(t, "two rows", func() bool { return len(parkedRows(t, st, parked.Filter{UUID: msg.UUID})) >= 2 })
	time.Sleep(50 * time.Millisecond)
	rows := parkedRows(t, st, parked.Filter{UUID: msg.UUID})
	handlers := map[string]int{}
	for _, r := range rows {
		handlers[r.Handler]++
	}
	if len(rows) != 2 || handlers["charge"] != 1 || handlers["ship"] != 1 {
		t.Fatalf("rows per handler %v; want one for charge and one for ship", handlers)
	}
}

// flakyPublisher fails the first n publishes to topic.
type flakyPublisher struct {
	message.Publisher
	topic  string
	n      atomic.Int64
	failed atomic.Int64
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.n.Add(-1) >= 0 {
		p.failed.Add(1)
		return errors.New("broker unreachable")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// A message whose row was written but whose copy the topic refused is
// deferred, and parked again on redelivery: one row, not two, one copy, and
// the handler not run again.
func TestParkedStoreRowOnceWhenTheCopyFails(t *testing.T) {
	t.Parallel()
	onEachDriver(t, rowOnceWhenTheCopyFails[*sql.Tx], rowOnceWhenTheCopyFails[pgx.Tx])
}

func rowOnceWhenTheCopyFails[TTx any](t *testing.T, d db[TTx]) {
	st, _ := parkedTable(t, d)
	store := &countingStore{ParkStore: st}
	h := &parkHarness{ps: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	h.router = router
	pub := &flakyPublisher{Publisher: h.ps, topic: deadCopies}
	pub.n.Store(3)
	copies, err := h.ps.Subscribe(t.Context(), deadCopies)
	must(t, err)
	var got atomic.Int64
	go func() {
		for m := range copies {
			got.Add(1)
			m.Ack()
		}
	}()
	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: claimsTable(t, d), ParkStore: store, Retry: fastRetry(),
		DeadLetterTopic: deadCopies, PoisonTopic: deadCopies, NackDelay: time.Millisecond, DisableTracing: true})
	must(t, err)
	_, err = p.Handle(parkHandler, parkTopic, h.ps, func(msg *message.Message) error {
		h.runs.add(parkHandler, msg.UUID)
		return fail(msg)
	})
	must(t, err)
	h.run(t)
	msg := failingOrder("poison", "20", "7bf92f3577b34da6a3ce929d0e0e4739")
	must(t, h.ps.Publish(parkTopic, msg))
	waitLong(t, "the copy", func() bool { return got.Load() == 1 })
	time.Sleep(50 * time.Millisecond)
	if n := len(parkedRows(t, st, parked.Filter{UUID: msg.UUID})); n != 1 {
		t.Fatalf("%d rows after %d failed copies; want 1", n, pub.failed.Load())
	}
	if calls, runs := store.calls.Load(), h.runs.get(parkHandler, msg.UUID); calls != 4 || runs != 1 || got.Load() != 1 {
		t.Fatalf("Park called %d times, handler run %d times, %d copies; want 4 (the row, then again on each of 3 redeliveries), 1, 1", calls, runs, got.Load())
	}
}

// A parked table that is gone (renamed away mid-run: a real outage) defers
// the delivery: not acked, not an attempt (the handler does not run
// again), until the table is back; then the message is parked once, with
// the attempts it had.
func TestParkedStoreOutageDefers(t *testing.T) {
	t.Parallel()
	onEachDriver(t, outageDefers[*sql.Tx], outageDefers[pgx.Tx])
}

func outageDefers[TTx any](t *testing.T, d db[TTx]) {
	st, table := parkedTable(t, d)
	store := &countingStore{ParkStore: st}
	h := newParkHarness(t, d, byPipelineHandle, store)
	h.run(t)
	d.exec(t, "ALTER TABLE "+d.quote(table)+" RENAME TO "+d.quote(table+"_off"))
	dead := failingOrder("dead", "21", "8bf92f3577b34da6a3ce929d0e0e4730")
	pois := failingOrder("poison", "22", "9bf92f3577b34da6a3ce929d0e0e4731")
	must(t, h.ps.Publish(parkTopic, dead, pois))
	// Each failed Park sends the message whole, 512 KiB of metadata, to
	// the database: a few seconds under -race and parallel tests.
	waitLong(t, "deferred parks", func() bool { return store.failed.Load() >= 4 })
	d.exec(t, "ALTER TABLE "+d.quote(table+"_off")+" RENAME TO "+d.quote(table))
	waitLong(t, "two rows", func() bool { return len(parkedRows(t, st, parked.Filter{})) >= 2 })
	time.Sleep(50 * time.Millisecond)
	for _, c := range []struct {
		msg      *message.Message
		attempts int
	}{{dead, 3}, {pois, 1}} {
		rows := parkedRows(t, st, parked.Filter{UUID: c.msg.UUID})
		if len(rows) != 1 || rows[0].Attempts != c.attempts {
			t.Fatalf("%s: %d rows, attempts %v; want one with %d attempts", c.msg.UUID, len(rows), attemptsOf(rows), c.attempts)
		}
		if n := h.runs.get(parkHandler, c.msg.UUID); n != c.attempts {
			t.Fatalf("%s: handler ran %d times through %d failed parks; want %d", c.msg.UUID, n, store.failed.Load(), c.attempts)
		}
	}
}

// blockingStore is a parked store in a consumer about to be killed: the
// first Park says it was called (entered) and every Park waits for killed,
// then fails without writing, as a process that died before its insert.
type blockingStore struct {
	entered chan struct{}
	once    sync.Once
	killed  chan struct{}
}

func (s *blockingStore) Park(ctx context.Context, _ settle.Parked) error {
	s.once.Do(func() { close(s.entered) })
	<-s.killed
	return errors.New("the consumer was killed before the row was written")
}

// amqpParkRouter runs a pipeline with store as its parked store (and no
// parking topic) for a handler of a's queue on sub that fails every
// message; it returns the router's stop function.
func amqpParkRouter[TTx any](t *testing.T, d db[TTx], a *batchAMQP, sub message.Subscriber, claims dedupe.Store, store settle.ParkStore, runs *runCounter) (stop func()) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Store: claims, ParkStore: store, Retry: fastRetry(),
		NackDelay: 5 * time.Millisecond, BusyDelay: 5 * time.Millisecond, DisableTracing: true})
	must(t, err)
	_, err = p.Handle(parkHandler, a.src, sub, func(msg *message.Message) error {
		runs.add(parkHandler, msg.UUID)
		return fail(msg)
	})
	must(t, err)
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			must(t, router.Close())
			must(t, <-done)
		})
	}
	t.Cleanup(stop)
	return stop
}

// amqpOrder is failingOrder within what RabbitMQ takes in one frame.
func amqpOrder(fate, id string) *message.Message {
	m := message.NewMessage(fate+"-"+id+"-"+watermill.NewShortUUID(), []byte(`{"id":"`+id+`"}`))
	m.Metadata.Set("fate", fate)
	m.Metadata.Set("order_id", id)
	m.Metadata.Set("binary", binaryValue)
	return m
}

// The original is acked only after its row commits: a consumer killed
// while its Park is in flight leaves the message on the queue, and the
// next consumer parks it, once. (Acked first, with the row written after,
// the message is lost: the broker has forgotten it, and the row never
// comes.)
func TestParkedStoreAcksOnlyAfterTheRowCommits(t *testing.T) {
	t.Parallel()
	d := stdOf(testenv.Postgres(t))
	st, _ := parkedTable(t, d)
	claims := claimsTable(t, d)
	a := newBatchAMQP(t, "pkack")
	var runs runCounter
	blocking := &blockingStore{entered: make(chan struct{}), killed: make(chan struct{})}
	stop := amqpParkRouter(t, d, a, a.sub, claims, blocking, &runs)
	msg := amqpOrder("poison", "23")
	must(t, a.pub.Publish(a.src, msg))
	select {
	case <-blocking.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("Park was not called")
	}
	// The consumer dies: its Park never writes, its connection goes.
	close(blocking.killed)
	stop()
	must(t, a.sub.Close())

	sub2, err := amqp.NewSubscriber(a.cfg, testenv.AMQPLogger(t, nil))
	must(t, err)
	t.Cleanup(func() { _ = sub2.Close() })
	amqpParkRouter(t, d, a, sub2, claims, st, &runs)
	deadline := time.Now().Add(15 * time.Second)
	for len(parkedRows(t, st, parked.Filter{UUID: msg.UUID})) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the message was lost: no row, queue depth %d, handler runs %d", a.depth(t, a.src), runs.get(parkHandler, msg.UUID))
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	if n, depth := len(parkedRows(t, st, parked.Filter{UUID: msg.UUID})), a.depth(t, a.src); n != 1 || depth != 0 {
		t.Fatalf("%d rows, %d messages left on the queue; want 1 and 0", n, depth)
	}
}

// A parked table gone mid-run, with RabbitMQ as the broker: the deliveries
// are deferred (nacked, requeued, the handler not run again) until the
// table is back, then each is parked once and the queue is empty.
func TestParkedStoreOutageDefersThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	d := stdOf(testenv.Postgres(t))
	st, table := parkedTable(t, d)
	store := &countingStore{ParkStore: st}
	a := newBatchAMQP(t, "pkout")
	var runs runCounter
	amqpParkRouter(t, d, a, a.sub, claimsTable(t, d), store, &runs)
	d.exec(t, "ALTER TABLE "+d.quote(table)+" RENAME TO "+d.quote(table+"_off"))
	dead, pois := amqpOrder("dead", "24"), amqpOrder("poison", "25")
	must(t, a.pub.Publish(a.src, dead, pois))
	deadline := time.Now().Add(15 * time.Second)
	for store.failed.Load() < 10 || runs.get(parkHandler, dead.UUID) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("%d failed parks, %d runs of the dead-lettered message", store.failed.Load(), runs.get(parkHandler, dead.UUID))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := d.count(t, "SELECT COUNT(*) FROM "+d.quote(table+"_off")); n != 0 {
		t.Fatalf("%d rows while the table was away", n)
	}
	d.exec(t, "ALTER TABLE "+d.quote(table+"_off")+" RENAME TO "+d.quote(table))
	deadline = time.Now().Add(15 * time.Second)
	for len(parkedRows(t, st, parked.Filter{})) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("rows not parked after the table came back")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	for _, c := range []struct {
		msg      *message.Message
		attempts int
	}{{dead, 3}, {pois, 1}} {
		rows := parkedRows(t, st, parked.Filter{UUID: c.msg.UUID})
		if len(rows) != 1 || rows[0].Attempts != c.attempts || rows[0].Metadata.Get("binary") != binaryValue {
			t.Fatalf("%s: %d rows, attempts %v; want one with %d attempts and the metadata whole", c.msg.UUID, len(rows), attemptsOf(rows), c.attempts)
		}
		if n := runs.get(parkHandler, c.msg.UUID); n != c.attempts {
			t.Fatalf("%s: handler ran %d times through %d failed parks; want %d", c.msg.UUID, n, store.failed.Load(), c.attempts)
		}
	}
	if depth := a.depth(t, a.src); depth != 0 {
		t.Fatalf("%d messages left on the queue", depth)
	}
}
