// Command reliability is settle's crash, restart and service-fault campaign
// (see docs/reliability.md). It runs a relay and two consumers as separate
// processes (this binary re-executed) on RabbitMQ, NATS JetStream or Redis
// Streams and PostgreSQL or MariaDB, kills a random one with SIGKILL at
// random points for -cycles cycles, optionally stops and restarts the
// services, lets everything drain and counts the effects of every logical
// message. From the harness's directory (bench, a module of its own):
//
//	go run ./reliability -db postgres://... -amqp amqp://... -cycles 200 -mode tx
//	go run ./reliability -db mysql://... -amqp amqp://... -cycles 200
//	go run ./reliability -db postgres://... -broker nats -nats nats://... -cycles 200 -mode batch
//	go run ./reliability -db postgres://... -broker redis -redis redis://... -cycles 200
//	go run ./reliability -db postgres://... -broker nats -cycles 30 -fault nats
//	go run ./reliability -db postgres://... -amqp amqp://... -mode plain -cycles 200
//	go run ./reliability -db postgres://... -amqp amqp://... -mode batch -cycles 200 -fail-rate 0.02
//	go run ./reliability -db postgres://... -amqp amqp://... -cycles 0 -fault rabbitmq,postgres,pgterminate
//
// The exit code is 1 when anything was lost, dead-lettered or left behind,
// when the drain did not finish in -drain-timeout, when a process gave up by
// itself, when a fault was not recovered from, when tx or batch mode shows a
// message with two effects, or when batch mode aimed kills at batches and
// none landed before a commit; 2 when the campaign could not run.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/settle-go/settle/internal/reliability"
)

func main() {
	if reliability.IsChild() {
		os.Exit(reliability.RunChild())
	}
	var cfg reliability.Config
	var faults string
	var seed int64
	flag.StringVar(&cfg.DB, "db", os.Getenv("SETTLE_POSTGRES_URL"), "database URL: postgres://... or mysql://... (default $SETTLE_POSTGRES_URL)")
	flag.StringVar(&cfg.Broker, "broker", reliability.BrokerAMQP, "broker: amqp (RabbitMQ), nats (NATS JetStream) or redis (Redis Streams)")
	flag.StringVar(&cfg.AMQP, "amqp", os.Getenv("SETTLE_AMQP_URL"), "RabbitMQ URL, for -broker amqp (default $SETTLE_AMQP_URL)")
	flag.StringVar(&cfg.NATS, "nats", os.Getenv("SETTLE_NATS_URL"), "NATS URL, for -broker nats (default $SETTLE_NATS_URL)")
	flag.StringVar(&cfg.Redis, "redis", os.Getenv("SETTLE_REDIS_URL"), "Redis URL, for -broker redis (default $SETTLE_REDIS_URL)")
	flag.StringVar(&cfg.Mode, "mode", reliability.ModeTx, "consumer mode: tx (HandleTx), plain (dedupe middleware, effect outside a transaction) or batch (HandleTx with group commit)")
	flag.IntVar(&cfg.Cycles, "cycles", 200, "kill-and-restart cycles")
	flag.IntVar(&cfg.Messages, "messages", 0, "logical messages placed during the kill cycles (default 5 per cycle, at least 100)")
	flag.StringVar(&faults, "fault", "", "comma-separated faults after the cycles: rabbitmq (-broker amqp), nats (-broker nats: nats-server stopped and started again), postgres, pgterminate, sigstop (a consumer stopped in its handler past its claim, woken after a takeover); a fault may repeat")
	flag.Int64Var(&seed, "seed", 0, "seed of the kill schedule (default: the clock)")
	flag.DurationVar(&cfg.MaxDelay, "max-delay", 100*time.Millisecond, "longest random wait before a kill")
	flag.DurationVar(&cfg.MaxSleep, "max-sleep", 10*time.Millisecond, "longest random sleep of a process in its handler, before an ack and after a forward")
	flag.IntVar(&cfg.BatchSize, "batch-size", 8, "batch mode: deliveries in flight per consumer and most per transaction")
	flag.BoolVar(&cfg.OneSubscription, "one-subscription", false, "batch mode, -broker amqp or redis: each consumer on one subscription (amqpsub's, redissub's) with -batch-size deliveries in flight, instead of -batch-size subscriptions of one delivery each")
	flag.DurationVar(&cfg.BatchWait, "batch-wait", 50*time.Millisecond, "batch mode: how long a batch's first delivery waits for others")
	flag.Float64Var(&cfg.Aim, "aim", 0.5, "batch mode: share of consumer kills that wait for a batch between its claim statement and its commit")
	flag.Float64Var(&cfg.StopRate, "stop-rate", 0, "share of the kill cycles that stop the process gracefully (SIGTERM, deliveries in flight) instead of SIGKILL")
	flag.Float64Var(&cfg.FailRate, "fail-rate", 0, "share of handler calls that fail on purpose (transient; tx and batch mode: after the effect row)")
	flag.DurationVar(&cfg.FaultHold, "fault-hold", 3*time.Second, "how long RabbitMQ or NATS stays stopped")
	flag.DurationVar(&cfg.DrainTimeout, "drain-timeout", 2*time.Minute, "bound of the final drain")
	flag.BoolVar(&cfg.Keep, "keep", false, "keep the tables, queues and process logs")
	flag.Parse()
	cfg.Seed = uint64(seed)
	if faults != "" {
		cfg.Faults = strings.Split(faults, ",")
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	cfg.Command = func() *exec.Cmd { return exec.Command(self) }
	cfg.Out = os.Stderr

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := reliability.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "reliability:", err)
		res.Print(os.Stdout)
		os.Exit(2)
	}
	res.Print(os.Stdout)
	if res.Err() != nil {
		os.Exit(1)
	}
}
