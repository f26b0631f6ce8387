package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// A handler that always fails is run MaxAttempts times, then a copy goes to
// the dead-letter topic and the original is acked.
func ExampleNewRetry() {
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()

	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pubsub, Topic: "emails.dead"})
	if err != nil {
		panic(err)
	}
	retry, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts:      3,
		InProcessRetries: 2, // all three attempts within this one delivery
		InitialInterval:  time.Millisecond,
	})
	if err != nil {
		panic(err)
	}
	send := dl(retry(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("attempt", msg.Metadata.Get(settle.MetaAttempt))
		return nil, errors.New("smtp: connection refused")
	}))

	_, err = send(message.NewMessage("welcome-42", []byte("hello")))
	fmt.Println("returned to the router:", err)

	dead, _ := pubsub.Subscribe(context.Background(), "emails.dead")
	m := <-dead
	m.Ack()
	fmt.Println(m.UUID, m.Metadata.Get(settle.MetaOutcome), "after", m.Metadata.Get(settle.MetaAttempt), "attempts:", m.Metadata.Get(settle.MetaReason))
	// Output:
	// attempt 1
	// attempt 2
	// attempt 3
	// returned to the router: <nil>
	// welcome-42 dead_lettered after 3 attempts: smtp: connection refused
}

// The tracing middleware, outermost, turns each delivery into a process span
// that ends at the settlement and records it (settle.settled): a plainly
// acked delivery is that one span; a nacked one has a nack span under it too.
// With nothing left for the router to publish, they have ended when the
// chain returns.
func ExampleNewTracing() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tracing, err := middleware.NewTracing(settle.WithTracerProvider(tp), settle.WithMessagingSystem("gochannel"))
	if err != nil {
		panic(err)
	}
	h := tracing(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })
	msg := message.NewMessage("m-1", nil)
	_, _ = h(msg)
	msg.Ack() // what the router does after the chain returns
	failing := tracing(func(msg *message.Message) ([]*message.Message, error) {
		return nil, errors.New("smtp: connection refused")
	})
	msg = message.NewMessage("m-2", nil)
	_, _ = failing(msg)
	msg.Nack()
	for _, s := range rec.Ended() {
		line := s.Name() + " " + s.SpanKind().String()
		for _, a := range s.Attributes() {
			if a.Key == "settle.settled" {
				line += " settled=" + a.Value.AsString()
			}
		}
		fmt.Println(line)
	}
	// Output:
	// process consumer settled=ack
	// nack client
	// process consumer settled=nack
}

// A router assembled by hand whose handler returns messages for the router
// to publish: the delivery's process span stays open while the router
// publishes, with an ack span under it for that wait. With TracePublished
// among its publisher decorators, both end when the router's publish
// returns, before the router acks, so they have ended when router.Close
// returns and a tracer provider shut down right after exports them.
func ExampleTracePublished() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tracing, err := middleware.NewTracing(settle.WithTracerProvider(tp))
	if err != nil {
		panic(err)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		panic(err)
	}
	router.AddPublisherDecorators(middleware.TracePublished)
	router.AddMiddleware(tracing)
	router.AddHandler("ship", "orders", pubsub, "shipments", pubsub, func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("shipment-of-"+msg.UUID, nil)}, nil
	})
	shipments, err := pubsub.Subscribe(context.Background(), "shipments")
	if err != nil {
		panic(err)
	}
	if err := pubsub.Publish("orders", message.NewMessage("order-1", nil)); err != nil {
		panic(err)
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	(<-shipments).Ack()

	if err := router.Close(); err != nil {
		panic(err)
	}
	_ = tp.Shutdown(context.Background()) // a span ending after this is dropped
	<-done
	for _, s := range rec.Ended() {
		fmt.Println(s.Name())
	}
	// Output:
	// create shipments
	// ack orders
	// process orders
}
