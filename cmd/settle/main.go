// Command settle operates what settle leaves behind: the parked-message
// table, dead-letter and poison queues on RabbitMQ, the dedupe table and the
// transactional outbox.
//
//	settle parked list    -db URL [-driver pgx|sql] [-table T] [FILTERS] [-limit N] [-after CURSOR] [-json]
//	settle parked show    -db URL [-table T] [-json] ID
//	settle parked groups  -db URL [-table T] [-handler H] [-outcome O] [-all] [-json]
//	settle parked replay  -db URL [-table T] (FILTERS | -all) [-outbox T] [-to TOPIC]
//	                      [-force] [-max-replays N] [-by WHO] [-yes]
//	settle parked archive -db URL [-table T] (FILTERS | -all) [-by WHO] [-yes]
//	settle parked purge   -db URL [-table T] [FILTERS] [-state S] -before TIME [-yes]
//	settle parked schema  -dialect postgres|mysql|sqlite [-table T]
//	settle dlq list     -queue Q [-json] [-limit N] [-force]
//	settle dlq show     -queue Q [-json] [-force] ID
//	settle dlq replay   -queue Q [-id ID ...] [-handler H] [-reason SUBSTR] [-all]
//	                    [-to Q | -allow-topics T,... | -any-destination] [-force] [-yes]
//	settle dedupe prune -db URL [-driver pgx|sql] [-table T] [-partition 24h] -older-than 7d [-force] [-yes]
//	settle dedupe show  -db URL [-driver pgx|sql] [-table T] (-handler H | -scope S) -key KEY
//	settle dedupe inflight -db URL [-driver pgx|sql] [-table T] [-limit N]
//	settle dedupe schema -dialect postgres|mysql|sqlite [-table T] [-partition 24h]
//	settle outbox schema -dialect postgres|mysql|sqlite [-topic T] [-upgrade]
//	settle outbox status -db URL [-driver pgx|sql] [-topic T] [-stuck-after D] [-list N] [-json]
//	settle outbox prune -db URL [-driver pgx|sql] [-topic T] -older-than 7d [-force] [-yes]
//	settle outbox retry -db URL [-driver pgx|sql] [-topic T] (-offset N ... | -dest T | -all) [-yes]
//	settle trace [-jaeger URL] (-id TRACE | -service S [-message UUID | -tag K=V]) [-svg FILE]
//	settle console -db URL [-driver pgx|sql] [-addr 127.0.0.1:8080] [-token-file F] [-read-only]
//	                    [-jaeger URL] [-table T] [-topic T] [-dedupe-table T]
//
// -db defaults to $SETTLE_POSTGRES_URL, else $SETTLE_MYSQL_URL, and -amqp to
// $SETTLE_AMQP_URL, the variables the tests and examples read. The
// database commands run on one sqldb.Driver, with the store and the outbox
// a service builds on it: on a postgres:// URL, sqldb.Pgx on a
// pgxpool.Pool; -driver sql runs them on sqldb.Std over database/sql
// instead, the only driver of mysql:// and sqlite://.
//
// The parked commands work on the parked-message table through
// parked.Store: FILTERS are -id -handler -topic -outcome -group -state
// -reason -uuid -key -since -until. parked replay writes each copy through
// the outbox in the transaction that marks its row replayed, so a replay
// run twice, at once or after an interruption publishes each message once.
// dedupe show says in words what the claims table knows of one key.
//
// Every command that changes or deletes something is a dry run unless -yes
// is given: it prints what it would do (how many rows or messages, and some
// of them; a prune selects them with the library's own filter). The prune
// commands refuse a retention below 24 hours unless -force is given.
// Listing and showing never remove a message from a queue, and refuse to
// read a queue that counts deliveries (a quorum queue, whose delivery limit
// would drop messages read too often) unless -force is given.
// replay removes a message from the dead-letter queue only after the broker
// has confirmed its republished copy, and refuses a selection that goes to
// several destinations unless -to, -allow-topics or -any-destination says
// where it may go. trace prints one trace from Jaeger's query API as a tree. console serves
// the web page of package console over the parked-message table, the outbox
// and the claims; on a loopback address only unless a token is given
// ($SETTLE_CONSOLE_TOKEN or -token-file).
//
// What came from outside (message headers and payloads, spans, servers'
// errors) is printed with control characters escaped, and no message shows
// a password, in whatever form a connection string was given. See
// docs/cli.md.
//
// The module is not published yet; install it from a clone of the
// repository with
//
//	go install ./cmd/settle
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
