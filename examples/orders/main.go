// Command orders is settle's main example: an order pipeline that places
// orders through the transactional outbox, charges each order exactly once in
// a transactional handler even when the broker delivers it twice, e-mails a
// confirmation through a flaky handler that retries and, for one order, gives
// up (dead-lettered), and gets a malformed message (poisoned). Both are
// parked in a table of the same database (package parked), where an operator
// finds, groups and replays them (settle parked, settle console).
//
// With no flags it runs on the embedded default, Watermill's GoChannel and a
// SQLite file, with no server:
//
//	go run ./examples/orders
//
// Against real services:
//
//	go run ./examples/orders -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable' -amqp 'amqp://guest:guest@127.0.0.1:5672/'
//
// -broker picks the broker: amqp (RabbitMQ, the default when an AMQP URL
// is given), nats (NATS JetStream, -nats), redis (Redis Streams, -redis),
// sql (watermill-sql on the -db database, which must be PostgreSQL) or gochannel.
// Each prints the same closing table; docs/brokers.md says which settings
// of each the guarantee needs, and the functions that build each broker's
// publisher and subscriber (brokers.go) are the configuration to copy.
//
//	go run ./examples/orders -broker nats -nats nats://127.0.0.1:4222
//	go run ./examples/orders -broker redis -redis redis://127.0.0.1:6379/0
//	go run ./examples/orders -broker sql -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//
// On a postgres:// URL settle runs on pgx: a pgxpool.Pool named once as
// sqldb.Pgx(pool), the dedupe store and the outbox on it, and a
// transactional handler whose function gets a pgx.Tx (pipeline.HandleTx
// with a TxConfig[pgx.Tx]), the outbox publisher bound to that pgx.Tx. On
// mysql:// and sqlite:// the same code runs on database/sql (sqldb.Std).
//
// -db defaults to $SETTLE_POSTGRES_URL, else $SETTLE_MYSQL_URL, -amqp to
// $SETTLE_AMQP_URL, -nats to $SETTLE_NATS_URL and -redis to
// $SETTLE_REDIS_URL: the variables the tests and the settle command read.
// With OTEL_EXPORTER_OTLP_ENDPOINT set (for example http://127.0.0.1:4318 for
// a local Jaeger) it exports a trace per order: placing it, the outbox relay,
// the charge, the e-mail, and how each delivery settled. See docs/tracing.md.
//
// Each run makes its own tables and queues (or streams), named after its run ID, and
// removes them when it ends; with -keep, or when it times out, it leaves them
// for a look and prints their names. A run removes what earlier runs left
// behind (killed, timed out, -keep) more than 10 minutes ago, and says so.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/settle-go/settle/internal/settleenv"
)

func main() {
	cfg := config{Out: os.Stdout, Err: os.Stderr}
	flag.IntVar(&cfg.Orders, "orders", 20, "number of orders to place")
	flag.StringVar(&cfg.DB, "db", "", "database URL: postgres://, mysql:// or sqlite:///path; default $"+settleenv.PostgresURL+", else $"+settleenv.MySQLURL+", else a new SQLite file")
	flag.StringVar(&cfg.Broker, "broker", "", "broker: gochannel, amqp (RabbitMQ), nats (JetStream), redis (Redis Streams) or sql (watermill-sql on the -db database, PostgreSQL); default amqp when -amqp or $"+settleenv.AMQPURL+" is set, else gochannel")
	flag.StringVar(&cfg.AMQP, "amqp", "", "RabbitMQ URL; default $"+settleenv.AMQPURL)
	flag.StringVar(&cfg.NATS, "nats", "", "NATS URL, a server with JetStream; default $"+settleenv.NATSURL)
	flag.StringVar(&cfg.Redis, "redis", "", "Redis URL; default $"+settleenv.RedisURL)
	flag.BoolVar(&cfg.Quiet, "quiet", false, "print only the final table")
	flag.BoolVar(&cfg.Keep, "keep", false, "keep this run's tables and queues, and earlier runs' leftovers, instead of removing them")
	flag.DurationVar(&cfg.Timeout, "timeout", 0, "give up when the pipeline has not settled after this long (default 60s)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), `usage: orders [flags]

Runs an order pipeline through settle: the outbox, a transactional charge that
runs once per order however often it is delivered, a flaky e-mail handler with
retries and a dead-letter, and a poison message. Prints a table of how every
delivery settled.

Environment: %s
OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4318) sends the traces to an
OTLP receiver such as Jaeger; OTEL_SERVICE_NAME names the service (default
settle-orders).

`, settleenv.Help)
		flag.PrintDefaults()
	}
	flag.Parse()
	// The environment is read after parsing, so that -h prints no password.
	if cfg.DB == "" {
		cfg.DB, _ = settleenv.DatabaseURL(os.Getenv)
	}
	if cfg.AMQP == "" {
		cfg.AMQP = os.Getenv(settleenv.AMQPURL)
	}
	if cfg.NATS == "" {
		cfg.NATS = os.Getenv(settleenv.NATSURL)
	}
	if cfg.Redis == "" {
		cfg.Redis = os.Getenv(settleenv.RedisURL)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, cfg)
	switch {
	case err == nil:
	case errors.Is(err, errInterrupted):
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(130)
	default:
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}
