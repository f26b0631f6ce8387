// Command settle operates what settle leaves behind: dead-letter and poison
// queues on RabbitMQ, the dedupe table and the transactional outbox.
//
//	settle dlq list     -queue Q [-json] [-limit N]
//	settle dlq show     -queue Q ID
//	settle dlq replay   -queue Q [-id ID ...] [-handler H] [-reason SUBSTR] [-all] [-yes]
//	settle dedupe prune -db URL [-driver pgx|sql] [-table T] -older-than 7d
//	settle dedupe schema -dialect postgres|mysql|sqlite [-table T]
//	settle outbox schema -dialect postgres|mysql|sqlite [-topic T] [-upgrade]
//	settle outbox status -db URL [-driver pgx|sql] [-topic T] [-stuck-after D] [-list N] [-json]
//	settle outbox prune -db URL [-driver pgx|sql] [-topic T] -older-than 7d
//	settle outbox retry -db URL [-driver pgx|sql] [-topic T] (-offset N ... | -dest T | -all) [-yes]
//	settle trace [-jaeger URL] (-id TRACE | -service S [-message UUID | -tag K=V]) [-svg FILE]
//
// -db defaults to $SETTLE_POSTGRES_URL, else $SETTLE_MYSQL_URL, and -amqp to
// $SETTLE_AMQP_URL, the variables the tests and examples read. On a
// postgres:// URL the database commands run on a pgxpool.Pool and settle's
// Pgx functions; -driver sql runs them on database/sql instead, the only
// driver of mysql:// and sqlite://. Listing and
// showing never remove a message from a queue; replay is a dry run unless
// -yes is given, and removes a message from the dead-letter queue only after
// the broker has confirmed its republished copy. trace prints one trace from
// Jaeger's query API as a tree. See docs/cli.md.
//
// Install it with
//
//	go install github.com/settle-go/settle/cmd/settle@latest
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := runContext(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
