package integration_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/internal/reliability"
	"github.com/settle-go/settle/internal/testenv"
)

// TestReliabilityShort is the CI-sized run of the reliability campaign (the
// command is bench/reliability; see docs/reliability.md). A relay and two
// consumers, each a process of its own (this test binary re-executed, see
// TestReliabilityHelperProcess), run settle's transactional handler on
// RabbitMQ and PostgreSQL while 20 SIGKILLs hit a random one of them at
// random points; then every connection of the run is killed with
// pg_terminate_backend while messages keep flowing. After the drain, every
// logical message placed in the outbox must have exactly one effect row in a
// table without a unique key: nothing lost, nothing doubled, nothing
// dead-lettered, and the consumers produce effects again after the fault.
//
// It is not parallel: it runs while the package's parallel tests wait, and
// its pg_terminate_backend only touches connections named after its own run.
func TestReliabilityShort(t *testing.T) {
	dbURL := testenv.Require(t, testenv.PostgresURLEnv)
	amqpURL := testenv.AMQPURL(t)
	res := runCampaign(t, reliability.Config{
		DB:       dbURL,
		AMQP:     amqpURL,
		Mode:     reliability.ModeTx,
		Cycles:   20,
		Messages: 100,
		Faults:   []string{reliability.FaultPGTerminate},
	})
	// Res.Err covers these; asserted one by one so a failure names them.
	wantEffects(t, res, 100)
	kills := 0
	for _, byPhase := range res.Kills {
		for _, n := range byPhase {
			kills += n
		}
	}
	if kills != 20 {
		t.Errorf("%d kills, want 20", kills)
	}
	if len(res.Faults) != 1 || !res.Faults[0].Recovered {
		t.Errorf("faults %+v: want one pgterminate, recovered", res.Faults)
	}
}

// TestReliabilityShortBatch is the CI-sized run of the campaign in batch
// mode (pipeline.TxConfig.Batch: the deliveries in flight in a consumer
// share one transaction, their keys claimed as confirmed in one statement,
// all acked after the commit), on PostgreSQL and on MariaDB: 20 SIGKILLs,
// every one aimed at a consumer waiting until it reports a transaction of two
// or more messages between its claim statement and its commit, and 5% of the
// handler calls failing after writing their effect (the batch runs again
// without the message). Afterwards the campaign checks, per kill, that the
// batch it reported left no row: the kill landed before the commit. Every
// placed message must have exactly one effect: a kill mid-batch loses
// nothing and doubles nothing. On PostgreSQL every connection of the run is
// then killed with pg_terminate_backend while messages keep flowing (batches
// open, their transactions begun while they fill), and the consumers must
// produce effects again. A third run, on PostgreSQL, has each consumer take
// its deliveries through one amqpsub subscription with all of a batch in
// flight, instead of one watermill-amqp subscription per delivery. Not
// parallel, like TestReliabilityShort; the runs go one after the other,
// about 10s each.
func TestReliabilityShortBatch(t *testing.T) {
	amqpURL := testenv.AMQPURL(t)
	for _, db := range []struct {
		name, env string
		faults    []string
		oneSub    bool // each consumer on one amqpsub subscription
	}{
		{"postgres", testenv.PostgresURLEnv, []string{reliability.FaultPGTerminate}, false},
		{"mariadb", testenv.MySQLURLEnv, nil, false},
		{"postgres-amqpsub", testenv.PostgresURLEnv, nil, true},
	} {
		t.Run(db.name, func(t *testing.T) {
			dbURL := testenv.Require(t, db.env)
			res := runCampaign(t, reliability.Config{
				DB:              dbURL,
				AMQP:            amqpURL,
				Mode:            reliability.ModeBatch,
				OneSubscription: db.oneSub,
				Cycles:          20,
				Messages:        200,
				Aim:             1,
				FailRate:        0.05,
				Faults:          db.faults,
			})
			wantEffects(t, res, 200)
			if len(res.Faults) != len(db.faults) {
				t.Errorf("faults %+v, want %v", res.Faults, db.faults)
			}
			for _, f := range res.Faults {
				if !f.Recovered {
					t.Errorf("fault %+v: the consumers did not produce effects again", f)
				}
			}
			if res.BatchKillsUncommitted == 0 {
				t.Errorf("%d kills aimed, %d in a batch, none before its commit: the campaign did not kill mid-batch", res.Aimed, res.BatchKills)
			}
			// Batching happened: fewer transactions than effects, and some
			// carried several messages.
			if res.LargestBatch < 3 || res.Transactions*3 > res.Effects*2 {
				t.Errorf("%d effects in %d transactions, at most %d in one: want batches", res.Effects, res.Transactions, res.LargestBatch)
			}
		})
	}
}

// TestReliabilityShortBrokers is the CI-sized run of the campaign on NATS
// JetStream and Redis Streams, PostgreSQL as the database: tx and batch
// mode on each, 30 kill cycles (12 in batch mode), half of them a graceful stop (SIGTERM: the
// process closes its router and subscriber with deliveries in flight,
// which a subscriber that acks what it gives up on would lose; on
// JetStream, a subscription without nats.ManualAck does) and half a
// SIGKILL; in batch mode every consumer kill is aimed at an open batch and
// 5% of the handler calls fail after their insert. The killed consumers'
// deliveries must come back through the broker alone (JetStream's AckWait,
// the Redis consumer group's claim of what a dead consumer left pending),
// and every placed message must have exactly one effect, nothing left
// unacked. Not parallel, like TestReliabilityShort; four runs of 5 to 15s.
func TestReliabilityShortBrokers(t *testing.T) {
	dbURL := testenv.Require(t, testenv.PostgresURLEnv)
	for _, tc := range []struct {
		broker, env, mode string
	}{
		{reliability.BrokerNATS, testenv.NATSURLEnv, reliability.ModeTx},
		{reliability.BrokerNATS, testenv.NATSURLEnv, reliability.ModeBatch},
		{reliability.BrokerRedis, testenv.RedisURLEnv, reliability.ModeTx},
		{reliability.BrokerRedis, testenv.RedisURLEnv, reliability.ModeBatch},
	} {
		t.Run(tc.broker+"-"+tc.mode, func(t *testing.T) {
			cfg := reliability.Config{
				DB:       dbURL,
				Broker:   tc.broker,
				Mode:     tc.mode,
				Cycles:   30,
				Messages: 150,
				StopRate: 0.5,
			}
			if tc.broker == reliability.BrokerNATS {
				cfg.NATS = testenv.Require(t, tc.env)
			} else {
				cfg.Redis = testenv.Require(t, tc.env)
			}
			if tc.mode == reliability.ModeBatch {
				// Fewer cycles: each aimed kill waits up to a second for a
				// batch.
				cfg.Cycles, cfg.Messages, cfg.Aim, cfg.FailRate = 12, 120, 1, 0.05
			}
			res := runCampaign(t, cfg)
			wantEffects(t, res, cfg.Messages)
			if res.LeftOnQueue != 0 {
				t.Errorf("%d deliveries left unacked on the broker", res.LeftOnQueue)
			}
			if res.GracefulStops == 0 || res.GracefulStops == cfg.Cycles {
				t.Errorf("%d graceful stops in %d cycles: want some SIGTERMs and some SIGKILLs", res.GracefulStops, cfg.Cycles)
			}
			if tc.mode == reliability.ModeBatch && res.BatchKillsUncommitted == 0 {
				t.Errorf("%d kills aimed, %d in a batch, none before its commit: the campaign did not kill mid-batch", res.Aimed, res.BatchKills)
			}
		})
	}
}

// TestReliabilityShortZombie is the CI-sized zombie run on MariaDB at its
// default isolation (REPEATABLE READ), tx mode: settle's transactional
// handler behind the dedupe middleware, whose handler reads before it
// writes, so that its transaction holds a snapshot in which its consumer
// owns the claim. After 10 SIGKILLs, three times a consumer is stopped with
// SIGSTOP in its handler (its effect written, not committed) for longer
// than the claim timeout; a second delivery of its message goes to the
// other consumer, which takes the claim over and commits the effect; then
// the zombie is woken and goes on to confirm and commit. No zombie may
// commit: every placed message has exactly one effect.
func TestReliabilityShortZombie(t *testing.T) {
	dbURL := testenv.Require(t, testenv.MySQLURLEnv)
	amqpURL := testenv.AMQPURL(t)
	res := runCampaignWithin(t, 240*time.Second, reliability.Config{
		DB:       dbURL,
		AMQP:     amqpURL,
		Mode:     reliability.ModeTx,
		Cycles:   6,
		Messages: 100,
		Faults:   []string{reliability.FaultSIGSTOP, reliability.FaultSIGSTOP, reliability.FaultSIGSTOP},
	})
	wantEffects(t, res, 100)
	if res.Zombies == 0 || res.ZombieCommits != 0 {
		t.Errorf("%d zombies (%d stops missed), %d committed after the takeover: want at least one zombie, none committing", res.Zombies, res.ZombieMisses, res.ZombieCommits)
	}
}

// runCampaign runs a campaign of cfg with this binary as its processes,
// within 90s, logs its output and table, and fails t if it did not finish
// or its verdict failed.
func runCampaign(t *testing.T, cfg reliability.Config) reliability.Result {
	t.Helper()
	return runCampaignWithin(t, 90*time.Second, cfg)
}

// runCampaignWithin is runCampaign within limit.
func runCampaignWithin(t *testing.T, limit time.Duration, cfg reliability.Config) reliability.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), limit)
	defer cancel()
	var log strings.Builder
	cfg.Command = func() *exec.Cmd {
		return exec.Command(os.Args[0], "-test.run=^TestReliabilityHelperProcess$", "-test.count=1")
	}
	cfg.DrainTimeout = 40 * time.Second
	cfg.Out = &log
	res, err := reliability.Run(ctx, cfg)
	var table strings.Builder
	res.Print(&table)
	t.Logf("campaign:\n%s\n%s", log.String(), table.String())
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Err(); err != nil {
		t.Fatal(err)
	}
	return res
}

// wantEffects checks one effect per placed message, at least placed of them.
func wantEffects(t *testing.T, res reliability.Result, placed int) {
	t.Helper()
	if res.Placed < placed || res.Effects != res.Placed || res.Lost != 0 || res.Duplicated != 0 {
		t.Errorf("placed %d, effects %d, lost %d, duplicated %d: want one effect per placed message", res.Placed, res.Effects, res.Lost, res.Duplicated)
	}
}

// TestReliabilityHelperProcess is not a test: it is a process of
// TestReliabilityShort's campaign (relay or consumer), run only when the
// campaign starts this binary with reliability.ChildEnv set.
func TestReliabilityHelperProcess(t *testing.T) {
	if !reliability.IsChild() {
		return
	}
	os.Exit(reliability.RunChild())
}
