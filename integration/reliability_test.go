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
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	var log strings.Builder
	res, err := reliability.Run(ctx, reliability.Config{
		DB:       dbURL,
		AMQP:     amqpURL,
		Mode:     reliability.ModeTx,
		Cycles:   20,
		Messages: 100,
		Faults:   []string{reliability.FaultPGTerminate},
		Command: func() *exec.Cmd {
			return exec.Command(os.Args[0], "-test.run=^TestReliabilityHelperProcess$", "-test.count=1")
		},
		DrainTimeout: 40 * time.Second,
		Out:          &log,
	})
	var table strings.Builder
	res.Print(&table)
	t.Logf("campaign:\n%s\n%s", log.String(), table.String())
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Err(); err != nil {
		t.Fatal(err)
	}
	// Res.Err covers these; asserted one by one so a failure names them.
	if res.Placed < 100 || res.Effects != res.Placed || res.Lost != 0 || res.Duplicated != 0 {
		t.Errorf("placed %d, effects %d, lost %d, duplicated %d: want one effect per placed message", res.Placed, res.Effects, res.Lost, res.Duplicated)
	}
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

// TestReliabilityHelperProcess is not a test: it is a process of
// TestReliabilityShort's campaign (relay or consumer), run only when the
// campaign starts this binary with reliability.ChildEnv set.
func TestReliabilityHelperProcess(t *testing.T) {
	if !reliability.IsChild() {
		return
	}
	os.Exit(reliability.RunChild())
}
