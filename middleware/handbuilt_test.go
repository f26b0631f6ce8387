package middleware_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/pipeline"
)

// seen is what one assembly of the stack did with the deliveries published
// to it.
type seen struct {
	mu       sync.Mutex
	attempts []int    // settle.SettlementFromContext(...).Attempt() of each run
	dead     []string // UUIDs copied to the dead-letter topic
	pois     []string
	acked    int
}

func (s *seen) snapshot() (attempts []int, dead, pois []string, acked int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.attempts...), append([]string(nil), s.dead...), append([]string(nil), s.pois...), s.acked
}

// assembly builds settle's stack on router for a handler of topic on ps,
// with handler h; it is either pipeline's or one made by hand.
type assembly func(t *testing.T, router *message.Router, ps *gochannel.GoChannel, retry middleware.RetryConfig, store dedupe.Store, h message.NoPublishHandlerFunc)

// byPipeline is the stack pipeline adds.
func byPipeline(t *testing.T, router *message.Router, ps *gochannel.GoChannel, retry middleware.RetryConfig, store dedupe.Store, h message.NoPublishHandlerFunc) {
	t.Helper()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps, Store: store, Retry: retry, DeadLetterTopic: deadTopic, PoisonTopic: poisonTopic,
		BusyDelay: time.Millisecond, UnavailableDelay: time.Millisecond, MaxUnavailableDelay: 4 * time.Millisecond, NackDelay: time.Millisecond,
		Tracing: []settle.Option{settle.WithTracerProvider(tp)},
	})
	must(t, err)
	_, err = p.Handle(handlerName, topic, ps, h)
	must(t, err)
}

// byHand is the stack assembled as package middleware's documentation says:
// tracing -> poison parking -> dead-letter parking -> retry (StoreCounts,
// since dedupe runs inside it) -> dedupe -> handler.
func byHand(t *testing.T, router *message.Router, ps *gochannel.GoChannel, retry middleware.RetryConfig, store dedupe.Store, h message.NoPublishHandlerFunc) {
	t.Helper()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	tr, err := middleware.NewTracing(settle.WithTracerProvider(tp))
	must(t, err)
	park := middleware.ParkConfig{Publisher: ps, NackDelay: time.Millisecond}
	park.Topic = poisonTopic
	ps1, err := middleware.NewPoison(park)
	must(t, err)
	park.Topic = deadTopic
	dl, err := middleware.NewDeadLetter(park)
	must(t, err)
	retry.StoreCounts = true
	rt, err := middleware.NewRetry(retry)
	must(t, err)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, BusyDelay: time.Millisecond,
		UnavailableDelay: time.Millisecond, MaxUnavailableDelay: 4 * time.Millisecond})
	must(t, err)
	router.AddConsumerHandler(handlerName, topic, ps, h).AddMiddleware(tr, ps1, dl, rt, dd)
}

// runAssembly publishes msgs one at a time to a new router with build's
// stack, waiting for each to be acked, and returns what happened.
func runAssembly(t *testing.T, build assembly, retry middleware.RetryConfig, msgs ...*message.Message) *seen {
	t.Helper()
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	must(t, err)
	s := &seen{}
	// The outermost router middleware sees what each delivery returned.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				s.mu.Lock()
				s.acked++
				s.mu.Unlock()
			}
			return out, err
		}
	})
	build(t, router, ps, retry, dedupe.NewMemoryStore(), func(msg *message.Message) error {
		s.mu.Lock()
		s.attempts = append(s.attempts, settle.SettlementFromContext(msg.Context()).Attempt())
		s.mu.Unlock()
		return nil
	})
	for _, c := range []struct {
		topic string
		into  *[]string
	}{{deadTopic, &s.dead}, {poisonTopic, &s.pois}} {
		parked, err := ps.Subscribe(t.Context(), c.topic)
		must(t, err)
		go func() {
			for m := range parked {
				s.mu.Lock()
				*c.into = append(*c.into, m.UUID)
				s.mu.Unlock()
				m.Ack()
			}
		}()
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	defer func() {
		must(t, router.Close())
		must(t, <-done)
		must(t, ps.Close())
	}()
	for i, m := range msgs {
		must(t, ps.Publish(topic, m))
		eventually(t, 5*time.Second, "delivery acked", func() bool {
			_, _, _, acked := s.snapshot()
			return acked >= i+1
		})
	}
	return s
}

// A router assembled by hand, in the order and with the settings package
// middleware documents, settles the first message a handler sees exactly as
// pipeline's stack does: here a message whose quorum-queue delivery count
// alone says its runs are used up (delivery 4, 2 runs per delivery, 5
// attempts), while the dedupe store, which counts the runs, has seen none.
// Both run it once, as attempt 1; neither dead-letters it.
func TestHandBuiltStackFirstMessageAsPipeline(t *testing.T) {
	t.Parallel()
	retry := fastRetry(5, 1)
	for _, c := range []struct {
		name  string
		build assembly
	}{{"pipeline", byPipeline}, {"by hand", byHand}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := runAssembly(t, c.build, retry, quorumDelivery(t, "m-1", 4), quorumDelivery(t, "m-2", 1))
			attempts, dead, pois, _ := s.snapshot()
			if len(attempts) != 2 || attempts[0] != 1 || attempts[1] != 1 || len(dead) != 0 || len(pois) != 0 {
				t.Fatalf("runs with attempts %v, dead-lettered %v, poisoned %v; want two runs, each attempt 1, nothing parked", attempts, dead, pois)
			}
		})
	}
}
