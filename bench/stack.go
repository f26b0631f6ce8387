package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
)

// Stack modes.
const (
	modeBare    = "bare"
	modeSpan    = "bare+span"
	modeSettle  = "settle"
	modeTracing = "settle+tracing"
	modeDropped = "settle+tracing-dropped"
	modeOTel    = "bare+otel"
)

var stackModes = []string{modeBare, modeSpan, modeOTel, modeSettle, modeTracing, modeDropped}

// stackAnchor is the cell each mode is compared with besides the bare
// router: what the same work costs without settle (bare+span for
// settle+tracing), or settle itself (for settle with a sampler that drops
// every trace, whose target is the cost over settle without tracing).
var stackAnchor = map[string]string{modeTracing: modeSpan, modeDropped: modeSettle}

// stackWindow is how many messages the publisher keeps in flight (published
// and not yet handled), as a broker's prefetch bounds them for a consumer.
const stackWindow = 64

// StackResults: section stack.
type StackResults struct {
	N     int                  `json:"n"`
	Modes map[string]StackCell `json:"modes"`
}

// StackCell is the median of one mode's runs.
type StackCell struct {
	Rate      float64   `json:"msgs_per_s"`
	Ratio     float64   `json:"ratio_to_bare"` // median of the per-round ratios
	AllocsMsg float64   `json:"allocs_per_msg"`
	BytesMsg  float64   `json:"bytes_per_msg"`
	All       []float64 `json:"all_msgs_per_s"`
	// CPUMsg is the process's CPU time (user and system, all threads) per
	// message, in microseconds (median): a figure that other work on a
	// shared machine disturbs less than the rate.
	CPUMsg float64 `json:"cpu_us_per_msg"`
	// Anchor is the mode this one is compared with besides bare
	// (stackAnchor), AnchorRatio the median of the per-round rate ratios to
	// it and AnchorCPU of the per-round ratios of CPU time per message.
	Anchor      string  `json:"anchor,omitempty"`
	AnchorRatio float64 `json:"ratio_to_anchor,omitempty"`
	AnchorCPU   float64 `json:"cpu_ratio_to_anchor,omitempty"`
	cpuMsg      time.Duration
}

// discardExporter drops spans after the batch processor collected them.
type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

func runStack(ctx context.Context, o options, log io.Writer) (*StackResults, error) {
	n := 200_000
	if o.quick {
		n = 50_000
	}
	res := &StackResults{N: n, Modes: map[string]StackCell{}}
	rates := map[string][]float64{}
	allocs := map[string][]float64{}
	bytes := map[string][]float64{}
	ratios := map[string][]float64{}
	cpus := map[string][]float64{}
	anchorRatios := map[string][]float64{}
	anchorCPU := map[string][]float64{}
	// Warm up once (page in code, grow the heap) so the first mode measured
	// is not penalised.
	if _, err := stackRun(ctx, modeSettle, n/10, dedupe.NewMemoryStore(), ""); err != nil {
		return nil, err
	}
	for r := range o.runs {
		for _, mode := range stackModes {
			prof := ""
			if o.profile != "" && r == o.runs-1 && mode != modeBare {
				prof = filepath.Join(o.profile, "stack-"+mode)
			}
			s, err := stackRun(ctx, mode, n, dedupe.NewMemoryStore(), prof)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(log, "run %d %s: %.0f msgs/s, %.1f allocs/msg, %.0f B/msg, %.2fµs CPU/msg\n", r+1, mode, s.Rate, s.AllocsMsg, s.BytesMsg, float64(s.cpuMsg.Nanoseconds())/1e3)
			rates[mode] = append(rates[mode], s.Rate)
			allocs[mode] = append(allocs[mode], s.AllocsMsg)
			bytes[mode] = append(bytes[mode], s.BytesMsg)
			ratios[mode] = append(ratios[mode], s.Rate/rates[modeBare][r])
			cpus[mode] = append(cpus[mode], float64(s.cpuMsg.Nanoseconds())/1e3)
		}
		// Anchors run earlier in the round (stackModes' order), so every
		// ratio is between runs of one round.
		for mode, a := range stackAnchor {
			anchorRatios[mode] = append(anchorRatios[mode], rates[mode][r]/rates[a][r])
			if c := cpus[mode][r]; c > 0 {
				anchorCPU[mode] = append(anchorCPU[mode], c/cpus[a][r])
			}
		}
	}
	for _, mode := range stackModes {
		all := append([]float64(nil), rates[mode]...)
		c := StackCell{Rate: median(rates[mode]), Ratio: median(ratios[mode]), AllocsMsg: median(allocs[mode]), BytesMsg: median(bytes[mode]), All: all, CPUMsg: median(cpus[mode])}
		if a, ok := stackAnchor[mode]; ok {
			c.Anchor, c.AnchorRatio = a, median(anchorRatios[mode])
			if len(anchorCPU[mode]) > 0 {
				c.AnchorCPU = median(anchorCPU[mode])
			}
		}
		res.Modes[mode] = c
	}
	return res, nil
}

// stackRun pushes n messages through a router on GoChannel with a no-op
// handler: the bare router, the bare router with one consumer span
// (spanFloor) or with the OpenTelemetry floor of DESIGN.md (otelFloor), or
// settle's stack (store, tracing off, on, or on with a sampler that drops
// every trace). With prof set it writes prof+".cpu" and prof+".allocs".
//
// The publisher keeps at most stackWindow messages in flight, as a broker's
// prefetch does: GoChannel starts two goroutines per published message that
// wait for the subscriber, so a publisher running ahead of the router by the
// whole run (as this harness did until 2026-12-02) leaves up to 2N goroutines
// parked on one mutex, whose creation, scheduling and scanning by the
// collector the bare router then pays per message as much as settle does:
// fixed costs that made every ratio look better than on a real broker.
// Each message carries a sampled W3C traceparent, as the output of a traced
// producer does, so that the spans continue a trace (and so that every mode
// copies a message with metadata, as a broker delivers it).
func stackRun(ctx context.Context, mode string, n int, store dedupe.Store, prof string) (StackCell, error) {
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, logger)
	defer ps.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return StackCell{}, err
	}
	var done atomic.Int64
	finished := make(chan struct{})
	window := make(chan struct{}, stackWindow)
	total := int64(n)
	handler := func(*message.Message) error {
		<-window
		if done.Add(1) == total {
			close(finished)
		}
		return nil
	}
	// Every tracing mode has the same SDK setup: the batch span processor
	// into an exporter that discards, the default sampler (parent-based,
	// always on) or, for modeDropped, one that drops every trace.
	providers := func(sampler sdktrace.Sampler) (*sdktrace.TracerProvider, *sdkmetric.MeterProvider, func()) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}), sdktrace.WithSampler(sampler))
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		return tp, mp, func() { _ = tp.Shutdown(context.Background()); _ = mp.Shutdown(context.Background()) }
	}
	sampled := sdktrace.ParentBased(sdktrace.AlwaysSample())
	switch mode {
	case modeBare:
		router.AddConsumerHandler("h", "t", ps, handler)
	case modeSpan:
		tp, _, stop := providers(sampled)
		defer stop()
		router.AddConsumerHandler("h", "t", ps, handler).AddMiddleware(spanFloor(tp))
	case modeOTel:
		tp, mp, stop := providers(sampled)
		defer stop()
		mw, err := otelFloor(tp, mp)
		if err != nil {
			return StackCell{}, err
		}
		router.AddConsumerHandler("h", "t", ps, handler).AddMiddleware(mw)
	default:
		cfg := pipeline.Config{Publisher: ps, Store: store, DisableTracing: mode == modeSettle}
		if mode == modeTracing || mode == modeDropped {
			sampler := sampled
			if mode == modeDropped {
				sampler = sdktrace.NeverSample()
			}
			tp, mp, stop := providers(sampler)
			defer stop()
			cfg.Tracing = []settle.Option{settle.WithTracerProvider(tp), settle.WithMeterProvider(mp)}
		}
		p, err := pipeline.New(router, cfg)
		if err != nil {
			return StackCell{}, err
		}
		if _, err := p.Handle("h", "t", ps, handler); err != nil {
			return StackCell{}, err
		}
	}
	runDone := make(chan error, 1)
	go func() { runDone <- router.Run(ctx) }()
	defer func() { _ = router.Close(); <-runDone }()
	select {
	case <-router.Running():
	case err := <-runDone:
		return StackCell{}, fmt.Errorf("router stopped: %w", err)
	}
	prefix := "m-" + randomID() + "-"
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(prefix+strconv.Itoa(i), nil)
		msgs[i].Metadata.Set("traceparent", traceparent(i))
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	stopProf, err := startProfile(prof)
	if err != nil {
		return StackCell{}, err
	}
	cpuBefore := processCPU()
	start := time.Now()
	pubErr := make(chan error, 1)
	stopPub := make(chan struct{})
	defer close(stopPub)
	go func() {
		for _, m := range msgs {
			select {
			case window <- struct{}{}:
			case <-stopPub:
				return
			}
			if err := ps.Publish("t", m); err != nil {
				pubErr <- err
				return
			}
		}
	}()
	select {
	case <-finished:
	case err := <-pubErr:
		stopProf()
		return StackCell{}, err
	case <-ctx.Done():
		stopProf()
		return StackCell{}, ctx.Err()
	case <-time.After(5 * time.Minute):
		stopProf()
		return StackCell{}, fmt.Errorf("%s: %d of %d messages handled in 5 minutes", mode, done.Load(), n)
	}
	elapsed := time.Since(start)
	cpu := processCPU() - cpuBefore
	stopProf()
	runtime.ReadMemStats(&after)
	return StackCell{
		Rate:      float64(n) / elapsed.Seconds(),
		AllocsMsg: float64(after.Mallocs-before.Mallocs) / float64(n),
		BytesMsg:  float64(after.TotalAlloc-before.TotalAlloc) / float64(n),
		cpuMsg:    cpu / time.Duration(n),
	}, nil
}

// traceparent is a sampled W3C trace context for message i: its own trace
// and parent span IDs.
func traceparent(i int) string {
	return fmt.Sprintf("00-%016x%016x-%016x-01", uint64(0x5e771e)+1, uint64(i)+1, uint64(i)+1)
}

// spanFloor is what watermill-opentelemetry's subscriber middleware adds to
// the bare router, written directly with the SDK: per delivery one consumer
// span, started from the trace context propagated in the metadata, with the
// messaging attributes, ended when the handler returns. The anchor of
// settle+tracing.
func spanFloor(tp *sdktrace.TracerProvider) message.HandlerMiddleware {
	tracer := tp.Tracer("floor")
	prop := propagation.TraceContext{}
	ids := []attribute.KeyValue{semconv.MessagingSystemKey.String("watermill"), attribute.String("settle.handler", "h"), semconv.MessagingDestinationName("t")}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			parent := prop.Extract(msg.Context(), propagation.MapCarrier(msg.Metadata))
			ctx, span := tracer.Start(parent, "process t", trace.WithSpanKind(trace.SpanKindConsumer),
				trace.WithAttributes(ids...),
				trace.WithAttributes(semconv.MessagingMessageID(msg.UUID), semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process")))
			orig := msg.Context()
			msg.SetContext(ctx)
			out, err := h(msg)
			msg.SetContext(orig)
			if err != nil {
				span.RecordError(err)
			}
			span.End()
			return out, err
		}
	}
}

// otelFloor is the least the tracing DESIGN.md asks for, made directly with
// the OpenTelemetry SDK and nothing of settle: per delivery the trace context
// read from the metadata, a consumer span around the handler with the
// messaging attributes and the settlement's (ended when the handler returns,
// not on the ack, which is cheaper than settle may do), and the two metric
// recordings with attribute sets built once.
func otelFloor(tp *sdktrace.TracerProvider, mp *sdkmetric.MeterProvider) (message.HandlerMiddleware, error) {
	tracer := tp.Tracer("floor")
	meter := mp.Meter("floor")
	settled, err := meter.Int64Counter("settlements")
	if err != nil {
		return nil, err
	}
	duration, err := meter.Float64Histogram("duration")
	if err != nil {
		return nil, err
	}
	set := attribute.NewSet(attribute.String("settle.outcome", "done"), attribute.String("settle.handler", "h"))
	add := []metric.AddOption{metric.WithAttributeSet(set)}
	record := []metric.RecordOption{metric.WithAttributeSet(set)}
	prop := propagation.TraceContext{}
	ids := []attribute.KeyValue{semconv.MessagingSystemKey.String("watermill"), attribute.String("settle.handler", "h"), semconv.MessagingDestinationName("t")}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			start := time.Now()
			parent := prop.Extract(msg.Context(), propagation.MapCarrier(msg.Metadata))
			ctx, span := tracer.Start(parent, "process t", trace.WithSpanKind(trace.SpanKindConsumer),
				trace.WithAttributes(ids...),
				trace.WithAttributes(semconv.MessagingMessageID(msg.UUID), semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process")))
			out, err := h(msg)
			span.SetAttributes(attribute.String("settle.outcome", "done"), attribute.Int("settle.attempt", 1), attribute.String("settle.settled", "ack"))
			span.End()
			settled.Add(ctx, 1, add...)
			duration.Record(ctx, time.Since(start).Seconds(), record...)
			return out, err
		}
	}, nil
}

// processCPU returns the CPU time the process has used so far, user and
// system, or 0 where getrusage fails.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// startProfile starts a CPU profile into prof+".cpu" and returns the function
// that stops it and writes the allocation profile to prof+".allocs". An empty
// prof profiles nothing.
func startProfile(prof string) (func(), error) {
	if prof == "" {
		return func() {}, nil
	}
	if err := os.MkdirAll(filepath.Dir(prof), 0o755); err != nil {
		return nil, err
	}
	f, err := os.Create(prof + ".cpu")
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
		if a, err := os.Create(prof + ".allocs"); err == nil {
			_ = pprof.Lookup("allocs").WriteTo(a, 0)
			_ = a.Close()
		}
	}, nil
}
