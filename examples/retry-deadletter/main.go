// Command retry-deadletter shows how settle ends the deliveries that fail:
// a consumer with the poison, dead-letter and retry middleware (no dedupe)
// handles five invoices. One succeeds at once, two fail transiently and
// succeed on a later attempt, one fails permanently and goes to the poison
// topic on its first failure, and one fails every time and goes to the
// dead-letter topic after MaxAttempts attempts. It prints where each message
// ended and the settle_* metadata of the dead-letter copy.
//
// It runs on Watermill's GoChannel, with no server:
//
//	go run ./examples/retry-deadletter
//
// Without a dedupe store or a broker that counts deliveries, the retry
// middleware counts attempts in the process: a restart forgets them. In
// production put the dedupe middleware inside the retry (or use
// pipeline.New, which does), so the count is durable; see docs/retry.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, config{}, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "retry-deadletter:", err)
		os.Exit(1)
	}
}
