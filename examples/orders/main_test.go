package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

func TestMain(m *testing.M) {
	testenv.Main(m,
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
		"parked rows":         {"2"},
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

// On PostgreSQL the example runs settle through pgx (a pgxpool.Pool).
func TestOrdersOnRabbitMQAndPostgreSQL(t *testing.T) {
	var out bytes.Buffer
	cfg := config{Orders: 20, Out: &out, DB: testenv.Require(t, testenv.PostgresURLEnv), AMQP: testenv.AMQPURL(t)}
	if err := run(t.Context(), cfg); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	checkReport(t, out.String())
	// PostgreSQL goes through pgx: the store, the charge's pgx.Tx, the
	// outbox publisher on it and the pgx relay, which forwarded every
	// "placed" and "charged" event.
	if !strings.Contains(out.String(), "rabbitmq + postgres via pgx") {
		t.Errorf("not on RabbitMQ and PostgreSQL through pgx:\n%s", out.String())
	}
	if got := row(t, out.String(), "outbox messages forwarded"); strings.Join(got, " ") != "40" {
		t.Errorf("outbox messages forwarded = %v, want 40 (20 placed, 20 charged)\n%s", got, out.String())
	}
}

// The example on every other broker, with PostgreSQL: the same closing table, the charges applied once
// each, the malformed message and the bounced e-mail parked, every outbox
// event forwarded, and nothing of the run left on the broker.
func TestOrdersOnEveryBroker(t *testing.T) {
	for _, tc := range []struct {
		broker, dbEnv, brokerEnv, system string
	}{
		{brokerNATS, testenv.PostgresURLEnv, testenv.NATSURLEnv, "nats + postgres via pgx"},
		{brokerRedis, testenv.PostgresURLEnv, testenv.RedisURLEnv, "redis + postgres via pgx"},
		{brokerSQL, testenv.PostgresURLEnv, "", "watermill-sql/postgresql + postgres via pgx"},
	} {
		t.Run(tc.broker+"/"+tc.system, func(t *testing.T) {
			t.Parallel()
			var out bytes.Buffer
			cfg := config{Orders: 20, Out: &out, Broker: tc.broker, DB: testenv.Require(t, tc.dbEnv)}
			if tc.broker == brokerSQL {
				// watermill-sql on PostgreSQL delivers nothing younger
				// than the oldest transaction open on the server, other
				// programs' included (docs/brokers.md): give a shared
				// server's long transactions time to end.
				cfg.Timeout = 3 * time.Minute
			}
			switch tc.broker {
			case brokerNATS:
				cfg.NATS = testenv.Require(t, tc.brokerEnv)
			case brokerRedis:
				cfg.Redis = testenv.Require(t, tc.brokerEnv)
			}
			if err := run(t.Context(), cfg); err != nil {
				t.Fatalf("run: %v\n%s", err, out.String())
			}
			checkReport(t, out.String())
			if !strings.Contains(out.String(), "orders: "+tc.system+", 20 orders") {
				t.Errorf("not on %s:\n%s", tc.system, out.String())
			}
			if got := row(t, out.String(), "outbox messages forwarded"); strings.Join(got, " ") != "40" {
				t.Errorf("outbox messages forwarded = %v, want 40 (20 placed, 20 charged)\n%s", got, out.String())
			}
			id := regexp.MustCompile(`\(run (` + runIDPattern + `)\)`).FindStringSubmatch(out.String())
			if id == nil {
				t.Fatalf("no run ID in the output:\n%s", out.String())
			}
			if left := brokerLeftovers(t, cfg, id[1]); len(left) > 0 {
				t.Errorf("the run left %v on the broker", left)
			}
		})
	}
}

// brokerLeftovers lists what of run id is still on the broker of cfg.
func brokerLeftovers(t *testing.T, cfg config, id string) []string {
	t.Helper()
	var left []string
	switch cfg.Broker {
	case brokerNATS:
		nc, err := nats.Connect(cfg.NATS)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, err := nc.JetStream()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range newTopicNames(id).all {
			if _, err := js.StreamInfo(s); err == nil {
				left = append(left, "stream "+s)
			}
		}
	case brokerRedis:
		opts, err := redis.ParseURL(cfg.Redis)
		if err != nil {
			t.Fatal(err)
		}
		c := redis.NewClient(opts)
		defer c.Close()
		n, err := c.Exists(t.Context(), newTopicNames(id).all...).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			left = append(left, fmt.Sprintf("%d streams", n))
		}
	case brokerSQL:
		db, d, err := sqlurl.Open(cfg.DB)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		q := "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?"
		if d == sqldb.Postgres {
			q = "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = $1"
		}
		for _, table := range brokerTableNames(id) {
			var n int
			if err := db.QueryRowContext(t.Context(), q, table).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				left = append(left, "table "+table)
			}
		}
	}
	return left
}

func TestOrdersRefusesBadInput(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 0, Out: &out}); err == nil {
		t.Fatal("run with -orders 0 succeeded")
	}
	if err := run(t.Context(), config{Orders: 1, DB: "oracle://x", Out: &out}); err == nil || !strings.Contains(err.Error(), "unsupported scheme") {
		t.Fatalf("run with an unsupported database URL: %v", err)
	}
	for _, tc := range []struct {
		cfg  config
		want string
	}{
		{config{Broker: "kafka"}, `-broker "kafka": want gochannel, amqp, nats, redis or sql`},
		{config{Broker: brokerNATS}, "-broker nats needs -nats or $SETTLE_NATS_URL"},
		{config{Broker: brokerRedis}, "-broker redis needs -redis or $SETTLE_REDIS_URL"},
		{config{Broker: brokerAMQP}, "-broker amqp needs -amqp or $SETTLE_AMQP_URL"},
		// The embedded default's SQLite file cannot be watermill-sql's
		// broker and the handlers' database at once.
		{config{Broker: brokerSQL}, "-broker sql needs a PostgreSQL database"},
	} {
		tc.cfg.Orders, tc.cfg.Out = 1, &out
		if err := run(t.Context(), tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run with -broker %q: %v; want %q", tc.cfg.Broker, err, tc.want)
		}
	}
}

// On MySQL, -broker sql is refused: watermill-sql's MySQL subscriber can
// skip a row published concurrently (docs/brokers.md).
func TestOrdersRefusesSQLBrokerOnMySQL(t *testing.T) {
	var out bytes.Buffer
	err := run(t.Context(), config{Orders: 1, Out: &out, Broker: brokerSQL, DB: testenv.Require(t, testenv.MySQLURLEnv)})
	if err == nil || !strings.Contains(err.Error(), "on MySQL watermill-sql's subscriber can skip a row") {
		t.Fatalf("run with -broker sql on MySQL: %v", err)
	}
}

// cancelOn is an output that cancels a context when a line containing
// trigger is written.
type cancelOn struct {
	bytes.Buffer
	trigger string
	cancel  context.CancelFunc
}

func (c *cancelOn) Write(p []byte) (int, error) {
	n, err := c.Buffer.Write(p)
	if strings.Contains(string(p), c.trigger) {
		c.cancel()
	}
	return n, err
}

// Ctrl-C says that the run was interrupted and prints the table so far.
func TestOrdersInterruptedShowsTheTableSoFar(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	out := &cancelOn{trigger: "orders: gochannel + sqlite", cancel: cancel}
	err := run(ctx, config{Orders: 20, Out: out})
	if !errors.Is(err, errInterrupted) {
		t.Fatalf("run = %v; want errInterrupted\n%s", err, out.String())
	}
	for _, want := range []string{"interrupted: placed 0 of 20 orders", "deliveries by outcome", "charges applied"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "kept for a look") {
		t.Errorf("an interrupted run kept its tables:\n%s", out.String())
	}
}

// With OTEL_EXPORTER_OTLP_ENDPOINT pointing at nothing, the run says where
// the traces go and warns that they could not be exported.
func TestOrdersWarnsWhenTracesCannotBeExported(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+addr)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	var out, warn bytes.Buffer
	if err := run(t.Context(), config{Orders: 3, Out: &out, Err: &warn}); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	if want := "traces: exported over OTLP/HTTP to http://" + addr + "/v1/traces"; !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}
	for _, want := range []string{"warning: exporting traces to http://" + addr + "/v1/traces failed", "spans were not exported"} {
		if !strings.Contains(warn.String(), want) {
			t.Errorf("warnings lack %q:\n%s", want, warn.String())
		}
	}
}

func TestOrdersSaysTracesAreNotExported(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 1, Out: &out}); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "traces: not exported; set OTEL_EXPORTER_OTLP_ENDPOINT") {
		t.Errorf("output does not say where traces go:\n%s", out.String())
	}
}

// On PostgreSQL and RabbitMQ: a run removes the tables and queues of an
// earlier run older than leftoverAge and says so, leaves a younger run's
// alone, and a run that times out keeps its own and names them.
func TestOrdersLeftoversAndTimeout(t *testing.T) {
	dbURL, amqpURL := testenv.Require(t, testenv.PostgresURLEnv), testenv.AMQPURL(t)
	db := testenv.Postgres(t)
	now := time.Now()
	old, young := newRunID(now.Add(-leftoverAge-time.Minute)), newRunID(now.Add(-time.Minute))
	for _, id := range []string{old, young} {
		for _, table := range tableNames(id) {
			if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+table+" (id INT)"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table) })
		}
	}
	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := newTopicNames(old).placed
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteQueues(amqpURL, []string{queue}) })
	exists := func(table string) bool {
		var n int
		if err := db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = $1", table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	var out bytes.Buffer
	err = run(t.Context(), config{Orders: 5, DB: dbURL, AMQP: amqpURL, Out: &out, Timeout: time.Nanosecond})
	if err == nil || !strings.Contains(err.Error(), "did not settle within 1ns") {
		t.Fatalf("run with a 1ns timeout: %v\n%s", err, out.String())
	}
	if want := fmt.Sprintf("removed what 1 earlier runs left behind (%s): %d tables, %d queues", old, len(tableNames(old)), len(newTopicNames(old).all)); !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}
	for _, table := range tableNames(old) {
		if exists(table) {
			t.Errorf("the old run's table %s is still there", table)
		}
	}
	if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil {
		t.Errorf("the old run's queue %s is still there", queue)
	}
	for _, table := range tableNames(young) {
		if !exists(table) {
			t.Errorf("a younger run's table %s was removed", table)
		}
	}

	// The timed-out run kept its tables and queues, and named them.
	m := regexp.MustCompile(`kept for a look \(run (` + runIDPattern + `)\): tables ([^;]+); queues (.+)\.`).FindStringSubmatch(out.String())
	if m == nil || !strings.Contains(out.String(), "timed out after 1ns: placed 0 of 5 orders") || !strings.Contains(out.String(), "deliveries by outcome") {
		t.Fatalf("the timed-out run does not say what it kept, or shows no table:\n%s", out.String())
	}
	id := m[1]
	t.Cleanup(func() {
		for _, table := range tableNames(id) {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table)
		}
		deleteQueues(amqpURL, newTopicNames(id).all)
	})
	for _, table := range tableNames(id) {
		if !exists(table) {
			t.Errorf("the timed-out run's table %s is gone", table)
		}
	}
	ch2, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch2.Close()
	for _, q := range newTopicNames(id).all {
		if _, err := ch2.QueueDeclarePassive(q, true, false, false, false, nil); err != nil {
			t.Errorf("the timed-out run's queue %s is gone: %v", q, err)
			break
		}
	}
}
