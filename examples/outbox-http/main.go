// Command outbox-http is an HTTP handler that writes an order and publishes
// its "order placed" event in one database transaction, through settle's
// transactional outbox. A relay forwards committed events to the broker and a
// consumer prints them. A request that fails validation inside the
// transaction (not enough stock) rolls back: no order row, and no event.
//
// By default it runs on Watermill's GoChannel and a SQLite file, sends a few
// requests to itself through an in-process test server, prints what the
// consumer received and exits:
//
//	go run ./examples/outbox-http
//
// With -serve it listens on -addr (default 127.0.0.1:8080) until interrupted:
//
//	go run ./examples/outbox-http -serve
//	curl -i -X POST localhost:8080/orders -d '{"id":"A-9","sku":"mug","qty":1}'
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.DB, "db", "", "SQLite file; default a temporary file")
	flag.BoolVar(&cfg.Serve, "serve", false, "listen on -addr until interrupted instead of sending requests to itself")
	flag.StringVar(&cfg.Addr, "addr", "127.0.0.1:8080", "address to listen on with -serve")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-http:", err)
		os.Exit(1)
	}
}
