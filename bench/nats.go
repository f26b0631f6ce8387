package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// NATS cells: how many deliveries each way of consuming JetStream puts in
// flight, and what it costs, with a handler that takes natsHandlerTime (a
// database round trip).
const (
	natsRaw         = "wm-nats"       // watermill-nats pkg/nats, ManualAck, router, handler alone
	natsAsync       = "wm-nats-async" // the same with JetStream.AckAsync
	natsSettle      = "settle"        // natsjs.NewSubscriber + pipeline (memory store), same handler
	natsPull        = "pull-fetch"    // nats.go pull consumer, Fetch(n), the n handled at once, acks async
	natsHandlerTime = time.Millisecond
)

var (
	natsCells = []string{natsRaw, natsAsync, natsSettle, natsPull}
	natsSubs  = []int{1, 4, 16}
)

// NATSResults: section nats.
type NATSResults struct {
	N         int       `json:"messages"`
	HandlerMS float64   `json:"handler_ms"`
	Rows      []NATSRow `json:"rows"`
}

// NATSRow is one SubscribersCount (or Fetch batch): median msgs/s and the
// most handlers seen running at once, per cell.
type NATSRow struct {
	Subscribers int                `json:"subscribers"`
	Rate        map[string]float64 `json:"msgs_per_s"`
	InFlight    map[string]int     `json:"max_in_flight"`
}

func natsURL() string { return env("SETTLE_NATS_URL", "nats://127.0.0.1:4222") }

func runNATS(ctx context.Context, o options, log io.Writer) (*NATSResults, error) {
	res := &NATSResults{N: 4000, HandlerMS: float64(natsHandlerTime) / float64(time.Millisecond)}
	if o.quick {
		res.N = 1500
	}
	nc, err := nats.Connect(natsURL())
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return nil, err
	}
	for _, s := range natsSubs {
		row := NATSRow{Subscribers: s, Rate: map[string]float64{}, InFlight: map[string]int{}}
		rates := map[string][]float64{}
		for r := range o.runs {
			for _, cell := range natsCells {
				stream := fmt.Sprintf("bench_nats_%d_%d_%d", time.Now().UnixNano(), s, r)
				if _, err := js.AddStream(&nats.StreamConfig{Name: stream, Subjects: []string{stream, stream + ".>"}}); err != nil {
					return nil, err
				}
				rate, inFlight, err := natsCell(ctx, js, cell, stream, s, res.N)
				_ = js.DeleteStream(stream)
				if err != nil {
					return nil, fmt.Errorf("%s subscribers %d: %w", cell, s, err)
				}
				fmt.Fprintf(log, "run %d s=%d %s: %.0f msgs/s, %d in flight at most\n", r+1, s, cell, rate, inFlight)
				rates[cell] = append(rates[cell], rate)
				row.InFlight[cell] = max(row.InFlight[cell], inFlight)
			}
		}
		for _, c := range natsCells {
			row.Rate[c] = median(rates[c])
		}
		res.Rows = append(res.Rows, row)
	}
	return res, nil
}

// natsCell publishes n messages to stream and consumes them all one way.
func natsCell(ctx context.Context, js nats.JetStreamContext, cell, stream string, subs, n int) (float64, int, error) {
	pub, err := wmnats.NewPublisher(natsjs.NewPublisherConfig(natsURL()), watermill.NopLogger{})
	if err != nil {
		return 0, 0, err
	}
	for i := range n {
		if err := pub.Publish(stream, message.NewMessage(fmt.Sprintf("m-%d", i), []byte(`{"n":1}`))); err != nil {
			_ = pub.Close()
			return 0, 0, err
		}
	}
	_ = pub.Close()

	var (
		running, most atomic.Int64
		done          atomic.Int64
		all           = make(chan struct{})
	)
	handle := func() {
		cur := running.Add(1)
		for {
			m := most.Load()
			if cur <= m || most.CompareAndSwap(m, cur) {
				break
			}
		}
		time.Sleep(natsHandlerTime)
		running.Add(-1)
		if done.Add(1) == int64(n) {
			close(all)
		}
	}
	wait := func(start time.Time) (float64, int, error) {
		select {
		case <-all:
			return float64(n) / time.Since(start).Seconds(), int(most.Load()), nil
		case <-time.After(5 * time.Minute):
			return 0, 0, fmt.Errorf("%d of %d messages handled", done.Load(), n)
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		}
	}

	if cell == natsPull {
		sub, err := js.PullSubscribe(stream, "pull", nats.AckExplicit(), nats.MaxAckPending(4*subs))
		if err != nil {
			return 0, 0, err
		}
		defer func() { _ = sub.Unsubscribe() }()
		start := time.Now()
		go func() {
			for done.Load() < int64(n) && ctx.Err() == nil {
				msgs, err := sub.Fetch(subs, nats.MaxWait(time.Second))
				if err != nil && !errors.Is(err, nats.ErrTimeout) {
					return
				}
				var wg sync.WaitGroup
				for _, m := range msgs {
					wg.Add(1)
					go func() { defer wg.Done(); handle(); _ = m.Ack() }()
				}
				wg.Wait()
			}
		}()
		return wait(start)
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return 0, 0, err
	}
	var sub message.Subscriber
	if cell == natsRaw || cell == natsAsync {
		// natsjs's settings, watermill-nats' own unmarshaler, no settle.
		sub, err = wmnats.NewSubscriber(wmnats.SubscriberConfig{
			URL: natsURL(), QueueGroupPrefix: "raw", SubscribersCount: subs,
			JetStream: wmnats.JetStreamConfig{DurablePrefix: "raw", AckAsync: cell == natsAsync,
				SubscribeOptions: []nats.SubOpt{nats.ManualAck(), nats.AckExplicit(), nats.MaxAckPending(4 * subs)}},
		}, watermill.NopLogger{})
		if err != nil {
			return 0, 0, err
		}
		r.AddConsumerHandler("raw", stream, sub, func(*message.Message) error { handle(); return nil })
	} else {
		sub, err = natsjs.NewSubscriber(natsURL(), natsjs.Config{Durable: "settle", SubscribersCount: subs}, watermill.NopLogger{})
		if err != nil {
			return 0, 0, err
		}
		pub, err := wmnats.NewPublisher(natsjs.NewPublisherConfig(natsURL()), watermill.NopLogger{})
		if err != nil {
			return 0, 0, err
		}
		defer func() { _ = pub.Close() }()
		p, err := pipeline.New(r, pipeline.Config{Publisher: pub, Store: dedupe.NewMemoryStore(), DisableTracing: true})
		if err != nil {
			return 0, 0, err
		}
		if _, err := p.Handle("settle", stream, sub, func(*message.Message) error { handle(); return nil }); err != nil {
			return 0, 0, err
		}
	}
	start := time.Now()
	go func() { _ = r.Run(ctx) }()
	rate, inFlight, err := wait(start)
	_ = r.Close()
	_ = sub.Close()
	return rate, inFlight, err
}

func natsTable(a *NATSResults) string {
	if a == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s messages pre-published, a handler of %.0f ms (a database round trip); msgs/s (median) and the most handlers seen running at once:\n\n", num(float64(a.N)), a.HandlerMS)
	b.WriteString("| SubscribersCount / Fetch batch | watermill-nats, AckSync | in flight | watermill-nats, AckAsync | settle (natsjs + pipeline, memory store) | in flight | ratio settle / watermill-nats AckSync | pull consumer, Fetch(n), async acks | in flight |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range a.Rows {
		fmt.Fprintf(&b, "| %d | %s | %d | %s | %s | %d | %s | %s | %d |\n", r.Subscribers,
			num(r.Rate[natsRaw]), r.InFlight[natsRaw], num(r.Rate[natsAsync]), num(r.Rate[natsSettle]), r.InFlight[natsSettle],
			x(ratio(r.Rate[natsSettle], r.Rate[natsRaw])), num(r.Rate[natsPull]), r.InFlight[natsPull])
	}
	return b.String()
}
