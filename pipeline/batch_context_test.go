package pipeline_test

import (
	"context"
	"database/sql"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
)

// The handlers of these tests do what a careful Go programmer does: they
// derive a context with a deadline of their own, cancel it when they return,
// and give it to the messages they publish through the outbox
// (m.SetContext). With group commit the outbox rows are written after the
// handler has returned, so settle must not write them under the handler's
// context.

// derivedCharge is e.charge (one charge row, one receipt on the outbox
// carrying the handler's context) run under a context derived from the
// handler's and cancelled when it returns.
func derivedCharge[TTx any](e *txEnv[TTx]) pipeline.TxFunc[TTx] {
	return func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		return e.charge(nil)(ctx, tx, msg, out)
	}
}

// derivedBatchCharge is the batch function of derivedCharge: every charge
// in one statement, one receipt per message, all under a context derived
// from the batch's and cancelled when it returns.
func derivedBatchCharge[TTx any](e *txEnv[TTx]) pipeline.BatchTxFunc[TTx] {
	return func(ctx context.Context, tx TTx, msgs []*message.Message, out message.Publisher) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := e.insertAll(ctx, tx, msgs); err != nil {
			return err
		}
		for _, m := range msgs {
			r := message.NewMessage("receipt-"+m.UUID, m.Payload)
			r.SetContext(ctx)
			if err := out.Publish("receipts", r); err != nil {
				return err
			}
		}
		return nil
	}
}

// outboxRows counts the outbox table's rows, forwarded or not.
func (e *txEnv[TTx]) outboxRows(t *testing.T) int {
	t.Helper()
	return e.db.count(t, "SELECT COUNT(*) FROM "+e.db.quote(e.ob.Table()))
}

// checkCharged requires every delivery to have succeeded, n charges, n
// outbox rows and every key confirmed.
func checkCharged(t *testing.T, errs []error, charges, rows int, confirmed func(key string) bool, msgs []*message.Message) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s: %v", msgs[i].UUID, err)
		}
	}
	n := len(msgs)
	if charges != n || rows != n {
		t.Errorf("charges=%d outbox rows=%d, want %d of each", charges, rows, n)
	}
	for _, m := range msgs {
		if !confirmed(m.UUID) {
			t.Errorf("key %s is not confirmed", m.UUID)
		}
	}
}

func (e *txEnv[TTx]) confirmed(t *testing.T) func(string) bool {
	return func(key string) bool {
		c, err := e.store.Claim(t.Context(), key, time.Minute)
		must(t, err)
		if c.Result == dedupe.Acquired {
			must(t, e.store.Release(t.Context(), c))
		}
		return c.Result == dedupe.Duplicate
	}
}

// Group commit, per-message handlers (TxConfig.Batch) and batch functions
// (NewBatchTxHandler), on every database: a handler that cancels the context
// it gave its outbox messages still has every message done, once.
func TestBatchOutboxOutlivesTheHandlersContext(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchOutboxOutlivesTheHandlersContext[*sql.Tx], batchOutboxOutlivesTheHandlersContext[pgx.Tx])
}

func batchOutboxOutlivesTheHandlersContext[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	batch := pipeline.BatchConfig{MaxSize: 8, MaxWait: 200 * time.Millisecond}
	// OneStatement writes its outbox rows while the handler runs; it is
	// here to show the modes agree.
	one, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob, Store: e.store, OneStatement: true}, derivedCharge(e))
	must(t, err)
	perMessage, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob, Store: e.store, Batch: batch}, derivedCharge(e))
	must(t, err)
	batchFn, err := pipeline.NewBatchTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob, Store: e.store, Batch: batch}, derivedBatchCharge(e))
	must(t, err)
	var all []*message.Message
	for _, c := range []struct {
		name string
		h    message.NoPublishHandlerFunc
	}{{"one-statement", one}, {"batch", perMessage}, {"batch-function", batchFn}} {
		msgs := orders(8, c.name)
		all = append(all, msgs...)
		errs := deliverAll(c.h, msgs)
		for i, err := range errs {
			if err != nil {
				t.Errorf("%s: %s: %v", c.name, msgs[i].UUID, err)
			}
		}
	}
	checkCharged(t, nil, e.rows(t), e.outboxRows(t), e.confirmed(t), all)
}

// The reproduction, through the whole pipeline: RabbitMQ via
// amqpsub (8 deliveries of one subscription in flight), HandleTx with Batch
// and HandleBatchTx (on database/sql and on pgx), handlers that
// cancel the context of their outbox messages. Every order is charged once
// with its receipt in the outbox, and nothing is dead-lettered or poisoned.
func TestBatchHandlersContextThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	type setup func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (charges, rows func() int)
	sqlSetup := func(open func(testing.TB) testenv.DB, batchFn bool) setup {
		return func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (func() int, func() int) {
			return contextSetup(t, stdOf(open(t)), batchFn, p, src, sub)
		}
	}
	pgxSetup := func(batchFn bool) setup {
		return func(t *testing.T, p *pipeline.Pipeline, src string, sub message.Subscriber) (func() int, func() int) {
			return contextSetup(t, pgxDB(t), batchFn, p, src, sub)
		}
	}
	for _, c := range []struct {
		name  string
		setup setup
	}{
		{"sqlite/batch", sqlSetup(testenv.SQLite, false)},
		{"postgres/batch", sqlSetup(testenv.Postgres, false)},
		{"postgres/batch-function", sqlSetup(testenv.Postgres, true)},
		{"mysql/batch", sqlSetup(testenv.MySQL, false)},
		{"mysql/batch-function", sqlSetup(testenv.MySQL, true)},
		{"pgx/batch", pgxSetup(false)},
		{"pgx/batch-function", pgxSetup(true)},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a := newBatchAMQP(t, "ctx")
			sub, err := amqpsub.NewSubscriber(amqpsub.Config{AMQP: a.cfg, InFlight: 8}, nil)
			must(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			must(t, err)
			p, err := pipeline.New(router, pipeline.Config{Publisher: a.pub, Retry: fastRetry(), DisableTracing: true,
				BusyDelay: 20 * time.Millisecond})
			must(t, err)
			charges, rows := c.setup(t, p, a.src, sub)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			t.Cleanup(func() {
				must(t, router.Close())
				must(t, <-done)
			})
			const n = 8
			a.publishOrders(t, "ctx", n)
			parked := func() int { return a.depth(t, a.src+".dead_letter") + a.depth(t, a.src+".poison") }
			deadline := time.Now().Add(30 * time.Second)
			for charges()+parked() < n && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(300 * time.Millisecond) // anything doubled arrives by then
			ch, r := charges(), rows()
			dl, ps := a.depth(t, a.src+".dead_letter"), a.depth(t, a.src+".poison")
			if ch != n || r != n || dl != 0 || ps != 0 {
				t.Fatalf("charges=%d outbox rows=%d dead-lettered=%d poisoned=%d; want %d charges and %d rows, none parked",
					ch, r, dl, ps, n, n)
			}
		})
	}
}

// contextSetup adds the handler of TestBatchHandlersContextThroughRabbitMQ
// on d to p.
func contextSetup[TTx any](t *testing.T, d db[TTx], batchFn bool, p *pipeline.Pipeline, src string, sub message.Subscriber) (charges, rows func() int) {
	e := newTxEnv(t, d)
	cfg := pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: e.ob, Store: e.store, Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 20 * time.Millisecond}}
	var err error
	if batchFn {
		_, err = pipeline.HandleBatchTx(p, "charge", src, sub, cfg, derivedBatchCharge(e))
	} else {
		_, err = pipeline.HandleTx(p, "charge", src, sub, cfg, derivedCharge(e))
	}
	must(t, err)
	return func() int { return e.rows(t) }, func() int { return e.outboxRows(t) }
}

// What settle keeps of the handler's context when it writes the batch's
// outbox rows: its values, so that each row continues the trace of the
// handler that published it (the outbox's create span is a child of the
// handler's span, and the row's metadata carries that trace).
func TestBatchOutboxKeepsTheHandlersTrace(t *testing.T) {
	t.Parallel()
	onEachDriver(t, batchOutboxKeepsTheHandlersTrace[*sql.Tx], batchOutboxKeepsTheHandlersTrace[pgx.Tx])
}

func batchOutboxKeepsTheHandlersTrace[TTx any](t *testing.T, d db[TTx]) {
	e := newTxEnv(t, d)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	name := testenv.Name(t, "tr")
	ob, err := outbox.New(d.Driver, outbox.Config{Topic: "tr_" + name[len(name)-8:],
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{})}})
	must(t, err)
	must(t, ob.InitSchema(t.Context()))
	t.Cleanup(func() {
		for _, tbl := range []string{ob.Table(), ob.Table() + "_relays"} {
			_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+d.quote(tbl))
		}
	})
	var mu sync.Mutex
	handlerSpans := map[string]trace.SpanContext{} // receipt UUID -> the span of the handler that published it
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: ob, Store: e.store,
		Batch: pipeline.BatchConfig{MaxSize: 8, MaxWait: 200 * time.Millisecond}},
		func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
			ctx, span := tp.Tracer("handler").Start(ctx, "charge")
			defer span.End()
			ctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			r := message.NewMessage("receipt-"+msg.UUID, msg.Payload)
			r.SetContext(ctx)
			mu.Lock()
			handlerSpans[r.UUID] = span.SpanContext()
			mu.Unlock()
			return out.Publish("receipts", r)
		})
	must(t, err)
	msgs := orders(8, "traced")
	for i, err := range deliverAll(h, msgs) {
		if err != nil {
			t.Fatalf("%s: %v", msgs[i].UUID, err)
		}
	}
	creates := 0
	for _, s := range rec.Ended() {
		if s.Name() != "create receipts" {
			continue
		}
		creates++
		var id string
		for _, a := range s.Attributes() {
			if a.Key == "messaging.message.id" {
				id = a.Value.AsString()
			}
		}
		if want := handlerSpans[id]; !want.IsValid() || s.Parent().SpanID() != want.SpanID() || s.SpanContext().TraceID() != want.TraceID() {
			t.Errorf("create span of %s: parent %v in trace %v, want the handler's span %v", id, s.Parent().SpanID(), s.SpanContext().TraceID(), want.SpanID())
		}
	}
	if creates != len(msgs) {
		t.Fatalf("%d create spans, want %d", creates, len(msgs))
	}
	rows, err := d.sql.QueryContext(t.Context(), "SELECT uuid, metadata FROM "+d.quote(ob.Table()))
	must(t, err)
	defer rows.Close()
	n := 0
	for rows.Next() {
		var id, md string
		must(t, rows.Scan(&id, &md))
		n++
		if want := handlerSpans[id].TraceID().String(); !strings.Contains(md, want) {
			t.Errorf("outbox row %s: metadata %s does not carry the handler's trace %s", id, md, want)
		}
	}
	must(t, rows.Err())
	if n != len(msgs) {
		t.Fatalf("%d outbox rows, want %d", n, len(msgs))
	}
}

// A producing handler (HandleProducing) that gives its output a context it
// derived and cancels when it returns: its messages are published after it
// returned (by the dedupe middleware with a Store, by the router without
// one), under their context's values but not its cancellation, so each
// reaches its queue once and nothing is dead-lettered.
func TestProducingHandlersContextThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	for _, withStore := range []bool{true, false} {
		name := "without-store"
		if withStore {
			name = "with-store"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			a := newBatchAMQP(t, "prod")
			out := a.src + ".out"
			_, err := a.ch.QueueDeclare(out, true, false, false, false, nil)
			must(t, err)
			t.Cleanup(func() { _, _ = a.ch.QueueDelete(out, false, false, false) })
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			must(t, err)
			cfg := pipeline.Config{Publisher: a.pub, Retry: fastRetry(), DisableTracing: true}
			if withStore {
				cfg.Store = claimsTable(t, stdOf(testenv.SQLite(t)))
			}
			p, err := pipeline.New(router, cfg)
			must(t, err)
			var runs atomic.Int64
			_, err = p.HandleProducing("ship", a.src, a.sub, out, func(msg *message.Message) ([]*message.Message, error) {
				runs.Add(1)
				ctx, cancel := context.WithTimeout(msg.Context(), time.Minute)
				defer cancel()
				m := message.NewMessage("ship-"+msg.UUID, msg.Payload)
				m.SetContext(ctx)
				return []*message.Message{m}, nil
			})
			must(t, err)
			done := make(chan error, 1)
			go func() { done <- router.Run(context.Background()) }()
			<-router.Running()
			t.Cleanup(func() {
				must(t, router.Close())
				must(t, <-done)
			})
			const n = 4
			a.publishOrders(t, "prod", n)
			parked := func() int { return a.depth(t, a.src+".dead_letter") + a.depth(t, a.src+".poison") }
			deadline := time.Now().Add(30 * time.Second)
			for a.depth(t, out)+parked() < n && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(300 * time.Millisecond)
			if got, dl, r := a.depth(t, out), parked(), runs.Load(); got != n || dl != 0 || r != n {
				t.Fatalf("published=%d parked=%d runs=%d; want %d published, none parked, %d runs", got, dl, r, n, n)
			}
		})
	}
}

// A pipeline cannot be assembled so that a producing handler has no
// publisher for its output: Config.Publisher is required, and
// HandleProducing needs its publish topic.
func TestPipelineRefusesAProducerWithoutPublisher(t *testing.T) {
	t.Parallel()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	must(t, err)
	if _, err := pipeline.New(router, pipeline.Config{Store: dedupe.NewMemoryStore()}); err == nil || !strings.Contains(err.Error(), "Config.Publisher") {
		t.Fatalf("New without a Publisher = %v; want it refused, naming Config.Publisher", err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: competingPublisher{}, Store: dedupe.NewMemoryStore()})
	must(t, err)
	produce := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	if _, err := p.HandleProducing("ship", "orders", competing{}, "", produce); err == nil || !strings.Contains(err.Error(), "publishTopic") {
		t.Fatalf("HandleProducing without a publish topic = %v; want it refused", err)
	}
}
