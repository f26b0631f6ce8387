package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// jaegerBinEnv names the Jaeger v2 binary built by scripts/jaeger.sh, as in
// the integration tests.
const jaegerBinEnv = "SETTLE_JAEGER_BIN"

// jaeger is a Jaeger v2 of one test, on ports of its own.
type jaeger struct {
	otlp, query string // host:port of OTLP/HTTP and the query API
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
}

// startJaeger runs Jaeger with the repository's loopback-only config, its
// ports replaced by free ones, and waits until it is healthy.
func startJaeger(t *testing.T) jaeger {
	t.Helper()
	bin := testenv.Require(t, jaegerBinEnv)
	cfg, err := os.ReadFile("../../tools/jaeger.yaml")
	if err != nil {
		t.Fatal(err)
	}
	// One pass over the file: replacing the ports one after another could
	// rewrite a port chosen for an earlier one (a free port 43171 for 13133
	// became 350531 when 4317 was replaced next).
	ports := map[string]string{}
	var pairs []string
	for _, p := range []string{"13133", "16686", "16685", "4317", "4318"} {
		ports[p] = freePort(t)
		pairs = append(pairs, "127.0.0.1:"+p, "127.0.0.1:"+ports[p])
	}
	cfg = []byte(strings.NewReplacer(pairs...).Replace(string(cfg)))
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "jaeger.yaml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "jaeger.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", cfgPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = logf.Close()
	})
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := client.Get("http://127.0.0.1:" + ports["13133"] + "/status")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return jaeger{otlp: "127.0.0.1:" + ports["4318"], query: "http://127.0.0.1:" + ports["16686"]}
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("Jaeger did not become healthy: %v\n%s", err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A real delivery's trace, exported to a real Jaeger, read back by "settle
// trace" as a tree: the producing handler's process span, the create span of
// its output under it, and the consumer's process span, poisoned, under
// that, with the parked copy's send span and the ack.
func TestTraceCommandShowsADeliveryFromJaeger(t *testing.T) {
	t.Parallel()
	j := startJaeger(t)
	service := testenv.Name(t, "svc")

	transport := &http.Transport{DisableKeepAlives: true}
	exp, err := otlptracehttp.New(t.Context(), otlptracehttp.WithEndpoint(j.otlp), otlptracehttp.WithInsecure(),
		otlptracehttp.WithHTTPClient(&http.Client{Transport: transport}))
	if err != nil {
		t.Fatal(err)
	}
	ended := tracetest.NewSpanRecorder() // to know when the last span has ended
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSpanProcessor(ended),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))))
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{
		Publisher: ps, Store: dedupe.NewMemoryStore(),
		Tracing: []settle.Option{settle.WithTracerProvider(tp), settle.WithPropagators(propagation.TraceContext{}),
			settle.WithMessagingSystem("gochannel")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.HandleProducing("ship", "orders", ps, "shipments", func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("ship-"+msg.UUID, nil)}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Handle("notify", "shipments", ps, func(*message.Message) error {
		return poison.Permanent(errors.New("no such customer"))
	}); err != nil {
		t.Fatal(err)
	}
	parked, err := ps.Subscribe(t.Context(), "shipments.poison")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	uuid := watermill.NewUUID()
	if err := ps.Publish("orders", message.NewMessage(uuid, nil)); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-parked:
		m.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("the produced message was not poisoned")
	}
	if err := errors.Join(router.Close(), <-done, ps.Close()); err != nil {
		t.Fatal(err)
	}
	// The poisoned delivery's process span ends at its settlement, which it
	// records; a span ended after the provider's shutdown would never be
	// exported.
	settled := time.Now().Add(10 * time.Second)
	for !hasEnded(ended, "process shipments") {
		if time.Now().After(settled) {
			t.Fatal("the process span of the poisoned delivery did not end within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := tp.Shutdown(context.Background()); err != nil { // all are exported now
		t.Fatal(err)
	}
	transport.CloseIdleConnections()

	// Jaeger stores what it received after its batch timeout.
	var r result
	deadline := time.Now().Add(20 * time.Second)
	for {
		r = runCmd(t.Context(), nil, "trace", "-jaeger", j.query, "-service", service, "-message", uuid)
		if r.code == exitOK && strings.Contains(r.stdout, "send shipments.poison") && strings.Count(r.stdout, "acked") == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("settle trace did not show the whole trace:\n%v", r)
		}
		time.Sleep(100 * time.Millisecond)
	}
	lines := strings.Split(r.stdout, "\n")
	if !strings.HasPrefix(lines[0], "trace ") || !strings.Contains(lines[0], "service "+service) {
		t.Errorf("header: %q", lines[0])
	}
	// depth returns the column where the span's name starts on its line.
	depth := func(name string) int {
		t.Helper()
		for _, l := range lines {
			if i := strings.Index(l, name); i >= 0 {
				return len([]rune(l[:i]))
			}
		}
		t.Fatalf("no line shows %q:\n%s", name, r.stdout)
		return 0
	}
	in, create, mid := depth("process orders"), depth("create shipments"), depth("process shipments")
	send := depth("send shipments.poison")
	if !(in < create && create < mid && mid < send) {
		t.Errorf("columns: process orders %d, create %d, process shipments %d, send %d; want each under the one before:\n%s",
			in, create, mid, send, r.stdout)
	}
	if strings.Contains(r.stdout, "ack shipments") || strings.Contains(r.stdout, "ack orders") {
		t.Errorf("a plain ack shows as a span of its own, want it on the process span:\n%s", r.stdout)
	}
	for _, want := range []string{"[handler notify, poisoned, attempt 1, parked to shipments.poison, acked, ERROR permanent: no such customer]", "└─ "} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("the tree lacks %q:\n%s", want, r.stdout)
		}
	}

	// The same trace by its ID, as an SVG picture.
	id := strings.TrimSuffix(strings.Fields(lines[0])[1], ":")
	svg := filepath.Join(t.TempDir(), "trace.svg")
	r = mustRun(t, exitOK, "trace", "-jaeger", j.query, "-id", id, "-svg", svg)
	b, err := os.ReadFile(svg)
	if err != nil || !strings.HasPrefix(string(b), "<svg ") || !strings.Contains(string(b), "process shipments [poisoned") {
		t.Errorf("-svg wrote %d bytes (%v):\n%.300s\n%v", len(b), err, b, r)
	}

	// Asking for what is not there says what is.
	r = mustRun(t, exitFail, "trace", "-jaeger", j.query, "-service", service, "-tag", "messaging.message.id=nosuch")
	if !strings.Contains(r.stderr, "no trace of service") || !strings.Contains(r.stderr, service) {
		t.Errorf("a tag no span has:\n%v", r)
	}
}

func TestTraceUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"trace"}, "say which trace"},
		{[]string{"trace", "-id", "abc", "-service", "s"}, "-id cannot be combined"},
		{[]string{"trace", "-service", "s", "-tag", "novalue"}, "-tag wants key=value"},
		{[]string{"trace", "-service", "s", "-tag", "a=b", "-message", "m"}, "-message cannot be combined with -tag"},
		{[]string{"trace", "-jaeger", "127.0.0.1:16686", "-id", "abc"}, "is not an http:// URL"},
	} {
		r := mustRun(t, exitUsage, tc.args...)
		if !strings.Contains(r.stderr, tc.stderr) {
			t.Errorf("%v: stderr lacks %q:\n%v", tc.args, tc.stderr, r)
		}
	}
	r := mustRun(t, exitFail, "trace", "-jaeger", "http://127.0.0.1:1", "-id", "abc")
	if !strings.Contains(r.stderr, "cannot reach Jaeger's query API at http://127.0.0.1:1") {
		t.Errorf("unreachable Jaeger:\n%v", r)
	}
}

// -in reads a saved answer of the query API: the newest matching trace is
// shown, and the command says how many others matched.
func TestTraceFromASavedResponse(t *testing.T) {
	t.Parallel()
	saved := `{"data":[
 {"traceID":"aa","processes":{"p1":{"serviceName":"svc"}},"spans":[
  {"spanID":"1","operationName":"process orders","startTime":1000,"duration":50,"processID":"p1",
   "tags":[{"key":"settle.outcome","value":"done"},{"key":"settle.handler","value":"charge"},{"key":"messaging.operation.type","value":"process"},{"key":"settle.settled","value":"ack"},{"key":"order.id","value":"A-1"}]}]},
 {"traceID":"bb","processes":{"p1":{"serviceName":"svc"}},"spans":[
  {"spanID":"3","operationName":"process orders","startTime":5000,"duration":70,"processID":"p1",
   "tags":[{"key":"settle.outcome","value":"retry"},{"key":"otel.status_code","value":"ERROR"},{"key":"otel.status_description","value":"boom"},{"key":"settle.settled","value":"nack"},{"key":"order.id","value":"A-1"}],
   "logs":[{"timestamp":5010,"fields":[{"key":"event","value":"settle.attempt_failed"},{"key":"settle.attempt","value":1}]}]},
  {"spanID":"4","operationName":"nack orders","startTime":5060,"duration":5,"processID":"p1","references":[{"refType":"CHILD_OF","spanID":"3"}]}]}]}`
	path := filepath.Join(t.TempDir(), "traces.json")
	if err := os.WriteFile(path, []byte(saved), 0o600); err != nil {
		t.Fatal(err)
	}
	r := mustRun(t, exitOK, "trace", "-in", path, "-tag", "order.id=A-1")
	want := "trace bb: 2 spans in 70µs, service svc\n\n" +
		"    start  duration  span\n" +
		"      0µs      70µs  process orders  [retry, nacked, ERROR boom]\n" +
		"     10µs               · settle.attempt_failed settle.attempt=1\n" +
		"     60µs       5µs  └─ nack orders\n"
	if r.stdout != want || !strings.Contains(r.stderr, "1 more traces match; showing the newest") {
		t.Errorf("got\n%s\nwant\n%s\nstderr: %s", r.stdout, want, r.stderr)
	}
	r = mustRun(t, exitOK, "trace", "-in", path, "-id", "aa")
	if !strings.Contains(r.stdout, "process orders  [handler charge, done, acked]") || strings.Contains(r.stdout, "ack orders") {
		t.Errorf("-id aa:\n%v", r)
	}
	mustRun(t, exitFail, "trace", "-in", path, "-tag", "order.id=A-2")
}

// hasEnded reports whether rec holds an ended span named name.
func hasEnded(rec *tracetest.SpanRecorder, name string) bool {
	for _, s := range rec.Ended() {
		if s.Name() == name {
			return true
		}
	}
	return false
}
