// Command dedupe-only adds settle's dedupe middleware, and nothing else of
// settle, to an existing Watermill router. The broker delivers the same
// "user signed up" message three times (what happens after a lost ack or a
// consumer restart); the welcome e-mail is sent once, and every delivery is
// acked.
//
// It runs on the embedded default, Watermill's GoChannel and a SQLite file,
// with no server:
//
//	go run ./examples/dedupe-only
//
// The claims live in a table of the SQLite file (-db, default a temporary
// file), so several processes sharing the file, or a PostgreSQL or MySQL
// database (a store on sqldb.Std with sqldb.Postgres or sqldb.MySQL), share them.
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
	flag.StringVar(&cfg.DB, "db", "", "SQLite file for the claims and the e-mails; default a temporary file")
	flag.IntVar(&cfg.Deliveries, "deliveries", 3, "how often the broker delivers the same message")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "dedupe-only:", err)
		os.Exit(1)
	}
}
