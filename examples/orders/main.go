// Command orders is settle's main example: an order pipeline that places
// orders through the transactional outbox, charges each order exactly once in
// a transactional handler even when the broker delivers it twice, e-mails a
// confirmation through a flaky handler that retries and, for one order, ends
// on the dead-letter topic, and sends a malformed message to the poison topic.
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
// (or SETTLE_DB_URL and SETTLE_AMQP_URL). With OTEL_EXPORTER_OTLP_ENDPOINT set
// (for example http://127.0.0.1:4318 for a local Jaeger) it exports a trace
// per order: placing it, the outbox relay, the charge, the e-mail, and how
// each delivery settled. See docs/tracing.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
)

func main() {
	cfg := config{Out: os.Stdout}
	flag.IntVar(&cfg.Orders, "orders", 20, "number of orders to place")
	flag.StringVar(&cfg.DB, "db", os.Getenv("SETTLE_DB_URL"), "database URL: postgres://, mysql:// or sqlite://; default a new SQLite file")
	flag.StringVar(&cfg.AMQP, "amqp", os.Getenv("SETTLE_AMQP_URL"), "RabbitMQ URL; default Watermill's in-process GoChannel")
	flag.BoolVar(&cfg.Quiet, "quiet", false, "print only the final table")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}
