package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/internal/testenv"
)

// JaegerBinEnv names the Jaeger v2 binary built by scripts/jaeger.sh.
const JaegerBinEnv = "SETTLE_JAEGER_BIN"

type jaegerSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64 `json:"startTime"`
	Duration  int64 `json:"duration"`
	Tags      []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
	Logs []struct {
		Fields []struct {
			Key   string `json:"key"`
			Value any    `json:"value"`
		} `json:"fields"`
	} `json:"logs"`
}

func (s jaegerSpan) tag(k string) string {
	for _, t := range s.Tags {
		if t.Key == k {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func (s jaegerSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

type jaegerTrace struct {
	TraceID string       `json:"traceID"`
	Spans   []jaegerSpan `json:"spans"`
}

// find returns the spans whose operation name starts with prefix and ends
// with suffix.
func (t jaegerTrace) find(prefix, suffix string) []jaegerSpan {
	var out []jaegerSpan
	for _, s := range t.Spans {
		if strings.HasPrefix(s.OperationName, prefix) && strings.HasSuffix(s.OperationName, suffix) {
			out = append(out, s)
		}
	}
	return out
}

func (t jaegerTrace) hasTag(k, v string) bool {
	for _, s := range t.Spans {
		if s.tag(k) == v {
			return true
		}
	}
	return false
}

// startJaeger runs Jaeger with the repository's loopback-only config and
// waits until it is healthy.
func startJaeger(t *testing.T) {
	t.Helper()
	bin := testenv.Require(t, JaegerBinEnv)
	cfg, err := filepath.Abs("../tools/jaeger.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", cfg)
	logf, err := os.Create(filepath.Join(t.TempDir(), "jaeger.log"))
	if err != nil {
		t.Fatal(err)
	}
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
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://127.0.0.1:13133/status")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("Jaeger did not become healthy: %v\n%s", err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func jaegerTraces(t *testing.T, service string) []jaegerTrace {
	t.Helper()
	resp, err := http.Get("http://127.0.0.1:16686/api/traces?limit=1000&service=" + service)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Data []jaegerTrace `json:"data"`
	}
	if resp.StatusCode != http.StatusOK {
		return nil // the service is unknown until its first span arrives
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	return body.Data
}

// The orders example, exporting over OTLP to a real Jaeger: one trace per
// order runs from the code that wrote the outbox row, through the relay, to
// the consumer's processing and its settlement; the order whose e-mail
// bounces shows each attempt and its row written in the parked-message
// store (the example parks in a table, not on a dead-letter topic).
func TestOrdersTraceInJaeger(t *testing.T) {
	startJaeger(t)
	bin := filepath.Join(t.TempDir(), "orders")
	build := exec.Command("go", "build", "-o", bin, "./examples/orders")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the example: %v\n%s", err, out)
	}
	service := testenv.Name(t, "orders")
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-orders", "10", "-quiet")
	cmd.Env = append(os.Environ(),
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318",
		"OTEL_SERVICE_NAME="+service,
		"SETTLE_POSTGRES_URL=", "SETTLE_MYSQL_URL=", "SETTLE_AMQP_URL=", // the embedded default
	)
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "every order charged exactly once") {
		t.Fatalf("the example failed: %v\n%s", err, out)
	}

	var traces []jaegerTrace
	deadline := time.Now().Add(30 * time.Second)
	for {
		traces = jaegerTraces(t, service)
		complete := 0
		for _, tr := range traces {
			for _, s := range tr.find("process orders_charged", "") {
				if s.tag("settle.settled") == "ack" {
					complete++
					break
				}
			}
		}
		if complete >= 10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Jaeger has %d traces of %s, %d complete; want 10", len(traces), service, complete)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Order A-001: one trace from the outbox write to the settlement.
	var first, bounced jaegerTrace
	for _, tr := range traces {
		switch {
		case tr.hasTag("order.id", "A-001"):
			first = tr
		case tr.hasTag("order.id", "A-007"):
			bounced = tr
		}
	}
	if first.TraceID == "" || bounced.TraceID == "" {
		t.Fatalf("no trace for order A-001 or A-007 among %d", len(traces))
	}
	one := func(tr jaegerTrace, prefix, suffix string) jaegerSpan {
		t.Helper()
		got := tr.find(prefix, suffix)
		if len(got) != 1 {
			t.Fatalf("trace %s: %d spans %q...%q, want 1", tr.TraceID, len(got), prefix, suffix)
		}
		return got[0]
	}
	place := one(first, "place order", "")
	create := one(first, "create orders_placed", "")
	send := one(first, "send orders_placed", "")
	process := one(first, "process orders_placed", "")
	// A plainly acked delivery is one span: the process span records the
	// settlement, and no ack span is made.
	if n := len(first.find("ack orders_placed", "")); n != 0 {
		t.Errorf("trace %s: %d ack spans for a plain ack, want none", first.TraceID, n)
	}
	for _, link := range []struct {
		child, parent jaegerSpan
	}{{create, place}, {send, create}, {process, send}} {
		if link.child.parent() != link.parent.SpanID {
			t.Errorf("%q is not a child of %q", link.child.OperationName, link.parent.OperationName)
		}
	}
	if process.tag("span.kind") != "consumer" || process.tag("settle.outcome") != "done" ||
		process.tag("messaging.operation.type") != "process" || process.tag("settle.settled") != "ack" {
		t.Errorf("process span tags %v; want a consumer span, done, settled by an ack", process.Tags)
	}
	if send.tag("messaging.system") == "" || create.tag("messaging.system") == "" {
		t.Errorf("the outbox's spans lack messaging.system: create %v, send %v", create.Tags, send.Tags)
	}

	// Order A-007: the e-mail's attempts and its dead-letter publish.
	emails := bounced.find("process orders_charged", "")
	outcomes := map[string]int{}
	events := 0
	var deadProcess jaegerSpan
	for _, s := range emails {
		outcomes[s.tag("settle.outcome")]++
		if s.tag("settle.outcome") == "dead_lettered" {
			deadProcess = s
		}
		for _, l := range s.Logs {
			for _, f := range l.Fields {
				if f.Key == "event" && f.Value == "settle.attempt_failed" {
					events++
				}
			}
		}
	}
	if outcomes["retry"] != 1 || outcomes["dead_lettered"] != 1 || events != 3 {
		t.Fatalf("A-007's e-mail deliveries: outcomes %v, %d failed-attempt events; want a retry, a dead-letter and 3 attempts", outcomes, events)
	}
	parkSpan := one(bounced, "park orders_charged", "")
	if parkSpan.parent() != deadProcess.SpanID || parkSpan.tag("settle.outcome") != "dead_lettered" {
		t.Errorf("the parked row is not a span under the dead-lettered delivery: %v", parkSpan.Tags)
	}
	if deadProcess.tag("otel.status_code") != "ERROR" {
		t.Errorf("the dead-lettered delivery's span has no error status: %v", deadProcess.Tags)
	}
	// The delivery handed back to the broker shows as a nack span under
	// its process span, which records the nack too.
	nack := one(bounced, "nack orders_charged", "")
	for _, s := range emails {
		if s.SpanID == nack.parent() && (s.tag("settle.settled") != "nack" || nack.tag("messaging.operation.type") != "settle") {
			t.Errorf("the nacked delivery: process span tags %v, nack span tags %v", s.Tags, nack.Tags)
		}
	}
}
