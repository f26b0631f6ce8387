package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// watermill-amqp v3.0.2 can redial a connection while its publisher
		// or subscriber is being closed (a select in its ConnectionWrapper
		// between "closing" and "connection closed"; internal/testenv's
		// AMQPLogger explains it and works around it in settle's own tests).
		// This example uses watermill-amqp as a user would, so its test
		// tolerates that connection: the example's process exits anyway.
		goleak.IgnoreAnyFunction("github.com/rabbitmq/amqp091-go.(*Connection).heartbeater"),
		goleak.IgnoreAnyFunction("github.com/rabbitmq/amqp091-go.(*Connection).reader"),
	)
}

// row returns the numbers of a line of the final table.
func row(t *testing.T, out, label string) []string {
	t.Helper()
	re := regexp.MustCompile(`(?m)^\s*` + regexp.QuoteMeta(label) + `((?:\s+\d+)+)\s*$`)
	m := re.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("output has no %q line:\n%s", label, out)
	}
	return strings.Fields(m[1])
}

func checkReport(t *testing.T, out string) {
	t.Helper()
	// 20 orders: 4 redelivered (5, 10, 15, 20), one bouncing e-mail (7),
	// one malformed message.
	want := map[string][]string{
		"done":                {"20", "19", "39"},
		"duplicate":           {"4", "0", "4"},
		"dead_lettered":       {"0", "1", "1"},
		"poisoned":            {"1", "0", "1"},
		"charges applied":     {"20"},
		"e-mails sent":        {"19"},
		"duplicates absorbed": {"4"},
	}
	for label, nums := range want {
		if got := row(t, out, label); strings.Join(got, " ") != strings.Join(nums, " ") {
			t.Errorf("%s = %v, want %v\n%s", label, got, nums, out)
		}
	}
	if !strings.Contains(out, "every order charged exactly once") || !strings.Contains(out, "progress: charged") {
		t.Errorf("output lacks the progress or the closing line:\n%s", out)
	}
}

func TestOrdersOnTheEmbeddedDefault(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 20, Out: &out}); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	checkReport(t, out.String())
	if !strings.Contains(out.String(), "gochannel + sqlite") {
		t.Errorf("not on the embedded default:\n%s", out.String())
	}
}

func TestOrdersOnRabbitMQAndPostgreSQL(t *testing.T) {
	var out bytes.Buffer
	cfg := config{Orders: 20, Out: &out, DB: testenv.Require(t, testenv.PostgresURLEnv), AMQP: testenv.AMQPURL(t)}
	if err := run(t.Context(), cfg); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	checkReport(t, out.String())
	if !strings.Contains(out.String(), "rabbitmq + postgres") {
		t.Errorf("not on RabbitMQ and PostgreSQL:\n%s", out.String())
	}
}

func TestOrdersRefusesBadInput(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 0, Out: &out}); err == nil {
		t.Fatal("run with -orders 0 succeeded")
	}
	if err := run(t.Context(), config{Orders: 1, DB: "oracle://x", Out: &out}); err == nil || !strings.Contains(err.Error(), "unsupported scheme") {
		t.Fatalf("run with an unsupported database URL: %v", err)
	}
}
