package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// process is the settle command as a process: the test binary, which is
// the command when execMainEnv is set (see TestMain).
func process(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), execMainEnv+"=1")
	return cmd
}

// parkMany parks n messages of one handler and failure group, each
// consumed from topic, and returns their UUIDs.
func (p *parkedEnv) parkMany(n int, topic string, payload int) []string {
	p.t.Helper()
	uuids := make([]string, n)
	body := strings.Repeat("x", payload)
	for i := range n {
		uuids[i] = fmt.Sprintf("bulk-%05d-%s", i, shortName(""))
	}
	workers := 4
	if p.dialect == "sqlite" {
		workers = 1 // one writer
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				msg := message.NewMessage(uuids[i], []byte(`{"pad":"`+body+`"}`))
				err := p.store.Park(p.t.Context(), settle.Parked{Message: msg, Outcome: settle.DeadLettered, Handler: "charge", Topic: topic,
					Cause: fmt.Errorf("card declined for order %d", i), Attempts: 1, LastFailure: time.Now()})
				if err != nil {
					p.t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if p.t.Failed() {
		p.t.FailNow()
	}
	return uuids
}

// assertOnce fails unless the outbox holds exactly one row, to topic, for
// the first replay of each of uuids, and no other row.
func (p *parkedEnv) assertOnce(uuids []string, topic string) {
	p.t.Helper()
	count, dest := p.outboxRows()
	bad := 0
	for _, u := range uuids {
		id := replay.UUID(u, "charge", 1)
		if count[id] != 1 || dest[id] != topic {
			bad++
			if bad <= 5 {
				p.t.Errorf("%s: %d outbox rows (to %q); want exactly 1", u, count[id], dest[id])
			}
		}
	}
	if len(count) != len(uuids) || bad > 0 {
		p.t.Fatalf("%d outbox rows for %d messages, %d messages without exactly one", len(count), len(uuids), bad)
	}
}

// Two `settle parked replay -yes` processes of the same group started at
// once, on every database and driver: every message gets exactly one
// outbox row; an outbox relay forwards them to RabbitMQ, where each is
// delivered once.
func TestParkedReplayConcurrentProcesses(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	for _, tc := range pruneDatabases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := setupParked(t, tc.url(t), tc.driver)
			queue := b.queue(t, "cli_replayed")
			uuids := p.parkMany(450, queue, 64) // three chunks of the store's replay
			args := p.args("parked replay", "-handler", "charge", "-yes")
			var wg sync.WaitGroup
			outs := make([]string, 2)
			errs := make([]error, 2)
			start := make(chan struct{})
			for i := range 2 {
				wg.Go(func() {
					cmd := process(t.Context(), args...)
					var out bytes.Buffer
					cmd.Stdout, cmd.Stderr = &out, &out
					<-start
					errs[i] = cmd.Run()
					outs[i] = out.String()
				})
			}
			close(start)
			wg.Wait()
			for i := range 2 {
				if errs[i] != nil {
					t.Fatalf("replay process %d: %v\n%s", i, errs[i], outs[i])
				}
			}
			p.assertOnce(uuids, queue)
			t.Logf("the two processes:\n%s\n%s", outs[0], outs[1])

			// Forward through a relay to RabbitMQ and consume.
			cfg := amqp.NewDurableQueueConfig(b.url)
			cfg.Publish.ConfirmDelivery = true
			pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			ob, err := outbox.New(sqldb.Std(p.db, sqldb.Dialect(p.dialect)), outbox.Config{Topic: p.outbox})
			if err != nil {
				t.Fatal(err)
			}
			n, err := ob.Forward(t.Context(), pub, outbox.RelayConfig{})
			if err != nil || n != int64(len(uuids)) {
				t.Fatalf("forwarded %d rows of %d: %v", n, len(uuids), err)
			}
			b.waitDepth(t, queue, len(uuids))
			delivered := map[string]int{}
			for _, d := range b.drain(t, queue) {
				of, _ := d.Headers[settle.MetaReplayOf].(string)
				delivered[of]++
			}
			for _, u := range uuids {
				if delivered[u] != 1 {
					t.Errorf("%s delivered %d times", u, delivered[u])
				}
			}
			if len(delivered) != len(uuids) {
				t.Fatalf("%d messages delivered, want %d", len(delivered), len(uuids))
			}
		})
	}
}

// A replay of thousands of rows killed (SIGKILL) in the middle, then run
// again: every message has exactly one outbox row.
func TestParkedReplayKilledAndRunAgain(t *testing.T) {
	t.Parallel()
	for _, tc := range pruneDatabases() {
		if tc.name == "postgres-sql" {
			continue // the same statements as pgx's; the database is what matters here
		}
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := setupParked(t, tc.url(t), tc.driver)
			topic := shortName("orders_")
			uuids := p.parkMany(2000, topic, 2048)
			args := p.args("parked replay", "-handler", "charge", "-yes")
			cmd := process(t.Context(), args...)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			// Kill it once some rows are in the outbox.
			deadline := time.Now().Add(30 * time.Second)
			for {
				var n int
				if err := p.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+p.quote(p.outbox)).Scan(&n); err != nil && p.dialect != "sqlite" {
					t.Fatal(err)
				}
				if n > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no outbox row after 30s:\n%s", out.String())
				}
				time.Sleep(time.Millisecond)
			}
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			err := cmd.Wait()
			if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
				t.Fatalf("the replay was not killed (it finished first: %v), the test proves nothing:\n%s", err, out.String())
			}
			count, _ := p.outboxRows()
			if len(count) == 0 || len(count) >= len(uuids) {
				t.Fatalf("killed with %d of %d rows in the outbox: want a replay killed in the middle", len(count), len(uuids))
			}
			t.Logf("killed after %d of %d rows", len(count), len(uuids))
			r := mustRun(t, exitOK, args...)
			if !strings.Contains(r.stdout, fmt.Sprintf("replaying %d parked messages", len(uuids)-len(count))) {
				t.Errorf("the second run:\n%v", r)
			}
			p.assertOnce(uuids, topic)
		})
	}
}
