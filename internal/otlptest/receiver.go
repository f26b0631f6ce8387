// Package otlptest is a real OTLP/HTTP trace receiver for tests: an HTTP
// server on 127.0.0.1 that decodes each export request as the OTLP
// protobuf, as a collector or Jaeger does, and keeps the spans it received.
// An exporter that cannot encode a request (a string that is not valid
// UTF-8) sends nothing, so what the receiver holds is what a collector
// would have stored.
package otlptest

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// Receiver is an OTLP/HTTP trace endpoint.
type Receiver struct {
	srv *httptest.Server

	mu       sync.Mutex
	spans    []*tracepb.Span
	requests int
	errs     []error
}

// New starts a receiver on 127.0.0.1, closed when the test ends.
func New(t testing.TB) *Receiver {
	t.Helper()
	r := &Receiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *Receiver) serve(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" {
		http.NotFound(w, req)
		return
	}
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(req.Body)
		if err != nil {
			r.fail(w, err)
			return
		}
		defer zr.Close()
		body = zr
	}
	b, err := io.ReadAll(body)
	if err != nil {
		r.fail(w, err)
		return
	}
	var export coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &export); err != nil {
		r.fail(w, err)
		return
	}
	r.mu.Lock()
	r.requests++
	for _, rs := range export.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	r.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = io.Copy(w, bytes.NewReader(out))
}

func (r *Receiver) fail(w http.ResponseWriter, err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
	http.Error(w, err.Error(), http.StatusBadRequest)
}

// Endpoint is the receiver's host:port, for otlptracehttp.WithEndpoint.
func (r *Receiver) Endpoint() string { return r.srv.Listener.Addr().String() }

// TracerProvider returns a tracer provider that exports to the receiver
// through otlptracehttp with a batch span processor (one export request
// for up to 512 spans, as the SDK's default), shut down when the test ends.
func (r *Receiver) TracerProvider(t testing.TB) *sdktrace.TracerProvider {
	t.Helper()
	exp, err := otlptracehttp.New(context.Background(),
		otlptracehttp.WithEndpoint(r.Endpoint()),
		otlptracehttp.WithInsecure(),
		otlptracehttp.WithRetry(otlptracehttp.RetryConfig{Enabled: false}),
	)
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Hour)))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp
}

// Spans returns the spans received so far.
func (r *Receiver) Spans() []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*tracepb.Span(nil), r.spans...)
}

// Requests is the number of export requests decoded.
func (r *Receiver) Requests() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests
}

// Errors returns the requests the receiver could not decode.
func (r *Receiver) Errors() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

// Attr returns the string form of span's attribute key, and whether it has it.
func Attr(span *tracepb.Span, key string) (string, bool) {
	return attrOf(span.GetAttributes(), key)
}

// EventAttr returns the attribute key of span's first event named name.
func EventAttr(span *tracepb.Span, name, key string) (string, bool) {
	for _, e := range span.GetEvents() {
		if e.GetName() == name {
			return attrOf(e.GetAttributes(), key)
		}
	}
	return "", false
}

func attrOf(kvs []*commonpb.KeyValue, key string) (string, bool) {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			return kv.GetValue().GetStringValue(), true
		}
	}
	return "", false
}
