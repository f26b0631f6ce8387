package pipeline_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/redissub"
)

// A handler that writes its keys in its own transaction (OneStatement,
// Batch, a batch function) counts attempts with the broker's delivery
// count. A message whose work committed, and whose ack was lost (two
// consumers died or froze holding it), comes back with a count that leaves
// no attempt: it is a duplicate, acked, because its key is confirmed, not
// dead-lettered (a parked copy, replayed, would do the work again). A
// message with the same count whose key was never confirmed is
// dead-lettered without its function running, and leaves its key refused
// (see TestFrozenWorkerDoesNotRunADeadLetteredMessage for why).
// Redis Streams is the broker (its delivery count is the one redissub
// marks as trusted).
func TestNoAttemptLeftConfirmedKeyIsDuplicate(t *testing.T) {
	testenv.RedisURL(t)
	for _, mode := range []string{"onestatement", "batch", "batchfunc"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			onEachDriver(t,
				func(t *testing.T, d db[*sql.Tx]) { noAttemptLeft(t, d, mode) },
				func(t *testing.T, d db[pgx.Tx]) { noAttemptLeft(t, d, mode) })
		})
	}
}

func noAttemptLeft[TTx any](t *testing.T, d db[TTx], mode string) {
	ctx := t.Context()
	opt, err := redis.ParseURL(testenv.RedisURL(t))
	must(t, err)
	rc := redis.NewClient(opt)
	t.Cleanup(func() { _ = rc.Close() })
	store, claims := claimsTableNamed(t, d)
	name := testenv.Name(t, "ll")
	effects := "effects_" + name[len(name)-8:]
	d.exec(t, "CREATE TABLE "+effects+" (msg VARCHAR(64) NOT NULL)")
	first, again := name+"_first", name+"_again"
	t.Cleanup(func() {
		_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+effects)
		rc.Del(context.Background(), first, again, first+".dead_letter", again+".dead_letter", first+".poison", again+".poison")
	})
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rc}, watermill.NopLogger{})
	must(t, err)

	var runs atomic.Int32 // runs of the function, per message
	effect := func(ctx context.Context, tx TTx, m *message.Message) error {
		runs.Add(1)
		_, err := d.Tx(tx).Exec(ctx, "INSERT INTO "+effects+" (msg) VALUES ("+d.ph(1)+")", m.UUID)
		return err
	}
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	run := func(stream string, settled func() bool) {
		t.Helper()
		sub, err := redissub.NewSubscriber(redissub.Config{Client: rc, ConsumerGroup: "g", MaxIdleTime: 100 * time.Millisecond, ClaimInterval: 50 * time.Millisecond}, watermill.NopLogger{})
		must(t, err)
		defer func() { _ = sub.Close() }()
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		must(t, err)
		p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store, Tracing: []settle.Option{settle.WithTracerProvider(tp)}})
		must(t, err)
		cfg := pipeline.TxConfig[TTx]{DB: d.Driver}
		switch mode {
		case "onestatement":
			cfg.OneStatement = true
			_, err = pipeline.HandleTx(p, "effect", stream, sub, cfg, func(ctx context.Context, tx TTx, m *message.Message, _ message.Publisher) error {
				return effect(ctx, tx, m)
			})
		case "batch":
			cfg.Batch = pipeline.BatchConfig{MaxSize: 4, MaxWait: 50 * time.Millisecond}
			_, err = pipeline.HandleTx(p, "effect", stream, sub, cfg, func(ctx context.Context, tx TTx, m *message.Message, _ message.Publisher) error {
				return effect(ctx, tx, m)
			})
		case "batchfunc":
			cfg.Batch = pipeline.BatchConfig{MaxSize: 4, MaxWait: 50 * time.Millisecond}
			_, err = pipeline.HandleBatchTx(p, "effect", stream, sub, cfg, func(ctx context.Context, tx TTx, ms []*message.Message, _ message.Publisher) error {
				for _, m := range ms {
					if err := effect(ctx, tx, m); err != nil {
						return err
					}
				}
				return nil
			})
		}
		must(t, err)
		done := make(chan struct{})
		go func() { defer close(done); _ = router.Run(context.WithoutCancel(ctx)) }()
		<-router.Running()
		defer func() { _ = router.Close(); <-done }()
		deadline := time.Now().Add(30 * time.Second)
		for !settled() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the deliveries were not settled", stream)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	pending := func(stream string) int64 {
		p, err := rc.XPending(ctx, stream, "g").Result()
		if err != nil {
			return -1
		}
		return p.Count
	}

	// order-1 is done: its effect and its key commit.
	must(t, pub.Publish(first, message.NewMessage("order-1", []byte("x"))))
	run(first, func() bool { return runs.Load() == 1 && pending(first) == 0 })

	// order-1 again, and order-2, never done, each delivered to two
	// consumers that never answered: the live one gets them with a
	// delivery count of 3, which leaves no attempt (5 attempts, 3 runs
	// taken for each earlier delivery).
	must(t, pub.Publish(again, message.NewMessage("order-1", []byte("x")), message.NewMessage("order-2", []byte("x"))))
	must(t, rc.XGroupCreateMkStream(ctx, again, "g", "0").Err())
	must(t, rc.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead-1", Streams: []string{again, ">"}, Count: 2}).Err())
	time.Sleep(20 * time.Millisecond)
	ids, _, err := rc.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: again, Group: "g", Consumer: "dead-2", MinIdle: 10 * time.Millisecond, Start: "0"}).Result()
	must(t, err)
	if len(ids) != 2 {
		t.Fatalf("claimed %d entries for the second dead consumer; want 2", len(ids))
	}
	outcomeOf := func(uuid string) string {
		for _, s := range spans.Ended() {
			if s.Name() != "process "+again {
				continue
			}
			var id, outcome string
			for _, a := range s.Attributes() {
				switch a.Key {
				case "messaging.message.id":
					id = a.Value.AsString()
				case "settle.outcome":
					outcome = a.Value.AsString()
				}
			}
			if id == uuid {
				return outcome
			}
		}
		return ""
	}
	run(again, func() bool {
		return pending(again) == 0 && outcomeOf("order-1") != "" && outcomeOf("order-2") != ""
	})

	if n := d.count(t, "SELECT COUNT(*) FROM "+effects+" WHERE msg = "+d.ph(1), "order-1"); n != 1 {
		t.Errorf("order-1's effect is in %d rows; want 1", n)
	}
	if n := d.count(t, "SELECT COUNT(*) FROM "+effects+" WHERE msg = "+d.ph(1), "order-2"); n != 0 {
		t.Errorf("order-2's effect is in %d rows; want none: it had no attempt left", n)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the function ran %d times; want once (order-1's first delivery)", n)
	}
	if got := outcomeOf("order-1"); got != string(settle.Duplicate) {
		t.Errorf("order-1's redelivery settled as %q; want %q", got, settle.Duplicate)
	}
	if got := outcomeOf("order-2"); got != string(settle.DeadLettered) {
		t.Errorf("order-2 settled as %q; want %q", got, settle.DeadLettered)
	}
	if n := d.count(t, "SELECT COUNT(*) FROM "+d.quote(claims)+" WHERE state = 2"); n != 1 {
		t.Errorf("the claims table has %d confirmed keys; want 1 (order-1's)", n)
	}
	if n := d.count(t, "SELECT COUNT(*) FROM "+d.quote(claims)+" WHERE state = 3"); n != 1 {
		t.Errorf("the claims table has %d refused keys; want 1 (order-2's): its refusal is committed before it is dead-lettered", n)
	}
	parked, err := rc.XRange(ctx, again+".dead_letter", "-", "+").Result()
	must(t, err)
	if len(parked) != 1 {
		t.Fatalf("%d copies on the dead-letter topic; want 1 (order-2's)", len(parked))
	}
	m, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(parked[0].Values)
	must(t, err)
	if got := m.Metadata.Get(settle.MetaOriginalUUID); got != "order-2" {
		t.Errorf("the dead-lettered copy is of %q; want order-2", got)
	}
}
