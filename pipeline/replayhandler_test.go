package pipeline_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/pipeline"
)

// Two handlers consume one topic. Order o1 fails in charge only (ship
// succeeds); o2 fails in both. Once fixed, the parked rows (three: one per
// handler and message) are replayed through the outbox and its relay to
// the topic, where every copy reaches both handlers: each handler must run
// again exactly the messages it failed, once each, and ack the copies of
// the other's rows as duplicates. The handlers are plain (Handle),
// transactional behind the dedupe middleware (HandleTx), one-statement
// (HandleTx, OneStatement) and batch (HandleBatchTx).
func TestReplayRunsOnlyTheHandlerThatFailed(t *testing.T) {
	t.Parallel()
	onEachDriver(t, replayRunsOnlyTheHandlerThatFailed[*sql.Tx], replayRunsOnlyTheHandlerThatFailed[pgx.Tx])
}

func replayRunsOnlyTheHandlerThatFailed[TTx any](t *testing.T, d db[TTx]) {
	for _, mode := range []string{"handle", "tx", "one-statement", "batch"} {
		t.Run(mode, func(t *testing.T) { replayToHandler(t, d, mode) })
	}
}

// inFlight2 is a GoChannel that says it has two deliveries in flight, so
// that a batch handler may be added to it; GoChannel hands a subscription
// one message at a time, so its batches are of one message.
type inFlight2 struct{ *gochannel.GoChannel }

func (inFlight2) InFlight() int { return 2 }

func replayToHandler[TTx any](t *testing.T, d db[TTx], mode string) {
	st, _ := parkedTable(t, d)
	claims := claimsTable(t, d)
	name := testenv.Name(t, "rh")
	suffix := name[len(name)-8:]
	ob, err := outbox.New(d.Driver, outbox.Config{Topic: "ob_" + suffix})
	must(t, err)
	must(t, ob.InitSchema(t.Context()))
	fx := "fx_" + suffix
	d.exec(t, "CREATE TABLE "+fx+" (handler VARCHAR(16) NOT NULL, order_id VARCHAR(16) NOT NULL)")
	t.Cleanup(func() {
		for _, tbl := range []string{fx, d.quote("ob_" + suffix), d.quote("ob_" + suffix + "_relays")} {
			_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+tbl)
		}
	})
	effects := func(handler, order string) int {
		return d.count(t, "SELECT COUNT(*) FROM "+fx+" WHERE handler = "+d.ph(1)+" AND order_id = "+d.ph(2), handler, order)
	}
	insert := "INSERT INTO " + fx + " (handler, order_id) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"

	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	must(t, err)
	// Outermost: the replayed copies each handler acked.
	var mu sync.Mutex
	acked := map[string]int{}
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.Metadata.Get(settle.MetaReplayOf) != "" {
				mu.Lock()
				acked[message.HandlerNameFromCtx(msg.Context())]++
				mu.Unlock()
			}
			return out, err
		}
	})
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: claims, ParkStore: st, Retry: fastRetry(),
		NackDelay: time.Millisecond, Tracing: []settle.Option{settle.WithTracerProvider(tp)}})
	must(t, err)

	var runs runCounter // per handler and order
	broken := map[string]bool{"charge/o1": true, "charge/o2": true, "ship/o2": true}
	fails := func(handler string, msg *message.Message) error {
		order := string(msg.Payload)
		runs.add(handler, order)
		mu.Lock()
		defer mu.Unlock()
		if broken[handler+"/"+order] {
			return fmt.Errorf("%s: order %s failed", handler, order)
		}
		return nil
	}
	for _, h := range []string{"charge", "ship"} {
		switch mode {
		case "handle":
			_, err = p.Handle(h, parkTopic, ps, func(msg *message.Message) error {
				if err := fails(h, msg); err != nil {
					return err
				}
				_, err := d.sql.ExecContext(msg.Context(), insert, h, string(msg.Payload))
				return err
			})
		case "tx", "one-statement":
			_, err = pipeline.HandleTx(p, h, parkTopic, ps, pipeline.TxConfig[TTx]{DB: d.Driver, OneStatement: mode == "one-statement"},
				func(ctx context.Context, tx TTx, msg *message.Message, _ message.Publisher) error {
					if err := fails(h, msg); err != nil {
						return err
					}
					_, err := d.Tx(tx).Exec(ctx, insert, h, string(msg.Payload))
					return err
				})
		case "batch":
			_, err = pipeline.HandleBatchTx(p, h, parkTopic, inFlight2{ps}, pipeline.TxConfig[TTx]{DB: d.Driver,
				Batch: pipeline.BatchConfig{MaxSize: 4, MaxWait: 5 * time.Millisecond}},
				func(ctx context.Context, tx TTx, msgs []*message.Message, _ message.Publisher) error {
					for i, msg := range msgs {
						if err := fails(h, msg); err != nil {
							return pipeline.MessageFailed(i, err)
						}
						if _, err := d.Tx(tx).Exec(ctx, insert, h, string(msg.Payload)); err != nil {
							return err
						}
					}
					return nil
				})
		}
		must(t, err)
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		must(t, router.Close())
		must(t, <-done)
		must(t, ps.Close())
	})

	for _, o := range []string{"o1", "o2"} {
		must(t, ps.Publish(parkTopic, message.NewMessage(o+"-"+watermill.NewShortUUID(), []byte(o))))
	}
	waitLong(t, "three rows parked", func() bool { return len(parkedRows(t, st, parked.Filter{})) == 3 })
	waitLong(t, "ship's effect of o1", func() bool { return effects("ship", "o1") == 1 })
	before := map[string]int{}
	for _, k := range []string{"charge/o1", "ship/o1", "charge/o2", "ship/o2"} {
		h, o, _ := strings.Cut(k, "/")
		before[k] = runs.get(h, o)
	}

	mu.Lock()
	clear(broken) // fixed
	mu.Unlock()
	res, err := st.Replay(t.Context(), ob, parked.Filter{}, parked.ReplayOptions{By: "test"})
	if err != nil || res.Replayed != 3 {
		t.Fatalf("replay: %+v, %v; want 3 rows replayed", res, err)
	}
	n, err := ob.Forward(t.Context(), ps, outbox.RelayConfig{})
	if err != nil || n != 3 {
		t.Fatalf("relay: %d, %v; want 3 copies published", n, err)
	}
	// Every copy reaches both handlers: three acked by each.
	waitLong(t, "each handler acks the three copies", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return acked["charge"] == 3 && acked["ship"] == 3
	})
	time.Sleep(100 * time.Millisecond) // anything more would arrive by then
	for _, c := range []struct {
		handler, order string
		again          int
	}{{"charge", "o1", 1}, {"ship", "o1", 0}, {"charge", "o2", 1}, {"ship", "o2", 1}} {
		k := c.handler + "/" + c.order
		if got := runs.get(c.handler, c.order) - before[k]; got != c.again {
			t.Errorf("%s ran %d times for %s after the replay; want %d", c.handler, got, c.order, c.again)
		}
		if got := effects(c.handler, c.order); got != 1 {
			t.Errorf("%d effects of %s for %s; want 1", got, c.handler, c.order)
		}
	}
	// The copies for the other handler settle as duplicates: ship's two
	// of charge's rows, charge's one of ship's.
	dups := 0
	for _, s := range rec.Ended() {
		if s.Name() != "process "+parkTopic {
			continue
		}
		for _, kv := range s.Attributes() {
			if kv.Key == attribute.Key("settle.outcome") && kv.Value.AsString() == "duplicate" {
				dups++
			}
		}
	}
	if dups != 3 {
		t.Errorf("%d deliveries settled as duplicates; want 3 (the copies for the other handler)", dups)
	}
}
