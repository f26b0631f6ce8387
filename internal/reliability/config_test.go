package reliability_test

import (
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/internal/reliability"
)

func TestRunRefusesBadConfig(t *testing.T) {
	t.Parallel()
	good := func() reliability.Config {
		return reliability.Config{
			DB: "postgres://127.0.0.1:1/none", AMQP: "amqp://127.0.0.1:1/",
			Cycles: 1, Command: func() *exec.Cmd { return exec.Command("true") },
		}
	}
	for _, tc := range []struct {
		name  string
		edit  func(*reliability.Config)
		field string
	}{
		{"no db", func(c *reliability.Config) { c.DB = "" }, "Config.DB"},
		{"no amqp", func(c *reliability.Config) { c.AMQP = "" }, "Config.AMQP"},
		{"unknown broker", func(c *reliability.Config) { c.Broker = "kafka" }, "Config.Broker"},
		{"no nats", func(c *reliability.Config) { c.Broker = reliability.BrokerNATS }, "Config.NATS"},
		{"no redis", func(c *reliability.Config) { c.Broker = reliability.BrokerRedis }, "Config.Redis"},
		{"one subscription on nats", func(c *reliability.Config) {
			c.Broker, c.NATS, c.Mode, c.OneSubscription = reliability.BrokerNATS, "nats://127.0.0.1:1", reliability.ModeBatch, true
		}, "Config.OneSubscription"},
		{"rabbitmq fault on redis", func(c *reliability.Config) {
			c.Broker, c.Redis, c.Faults = reliability.BrokerRedis, "redis://127.0.0.1:1/0", []string{reliability.FaultRabbitMQ}
		}, "Config.Faults"},
		{"nats fault on rabbitmq", func(c *reliability.Config) { c.Faults = []string{reliability.FaultNATS} }, "Config.Faults"},
		{"bad mode", func(c *reliability.Config) { c.Mode = "exactly-once" }, "Config.Mode"},
		{"negative cycles", func(c *reliability.Config) { c.Cycles = -1 }, "Config.Cycles"},
		{"negative messages", func(c *reliability.Config) { c.Messages = -5 }, "Config.Messages"},
		{"delays inverted", func(c *reliability.Config) { c.MinDelay, c.MaxDelay = time.Second, time.Millisecond }, "Config.MinDelay"},
		{"negative sleep", func(c *reliability.Config) { c.MaxSleep = -time.Millisecond }, "Config.MaxSleep"},
		{"batch of one", func(c *reliability.Config) { c.Mode, c.BatchSize = reliability.ModeBatch, 1 }, "Config.BatchSize"},
		{"aim above one", func(c *reliability.Config) { c.Aim = 1.5 }, "Config.Aim"},
		{"stop rate above one", func(c *reliability.Config) { c.StopRate = 1.5 }, "Config.StopRate"},
		{"negative fail rate", func(c *reliability.Config) { c.FailRate = -0.1 }, "Config.FailRate"},
		{"fail rate too high", func(c *reliability.Config) { c.FailRate = 0.9 }, "Config.FailRate"},
		{"no command", func(c *reliability.Config) { c.Command = nil }, "Config.Command"},
		{"unknown fault", func(c *reliability.Config) { c.Faults = []string{"disk"} }, "Config.Faults"},
		{"sigstop in batch mode", func(c *reliability.Config) {
			c.Mode, c.Faults = reliability.ModeBatch, []string{reliability.FaultSIGSTOP}
		}, "Config.Faults"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := good()
			tc.edit(&cfg)
			_, err := reliability.Run(t.Context(), cfg)
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("Run: %v, want an error naming %s", err, tc.field)
			}
		})
	}
}

func TestResultErr(t *testing.T) {
	t.Parallel()
	ok := reliability.Result{Mode: reliability.ModeTx, Placed: 10, Effects: 10}
	if err := ok.Err(); err != nil {
		t.Fatalf("clean result: %v", err)
	}
	batch := reliability.Result{Mode: reliability.ModeBatch, Placed: 10, Effects: 10, Aimed: 3, BatchKills: 2, BatchKillsUncommitted: 1}
	if err := batch.Err(); err != nil {
		t.Fatalf("clean batch result: %v", err)
	}
	plainDup := reliability.Result{Mode: reliability.ModePlain, Placed: 10, Effects: 11, Duplicated: 1, Extra: 1}
	if err := plainDup.Err(); err != nil {
		t.Fatalf("a duplicate in plain mode is the documented window, not a failure: %v", err)
	}
	for _, r := range []reliability.Result{
		{Mode: reliability.ModeTx, Duplicated: 1},
		{Mode: reliability.ModeBatch, Duplicated: 1},
		// Kills aimed at batches, none of which landed before a commit: the
		// campaign did not test what batch mode is for.
		{Mode: reliability.ModeBatch, Aimed: 5, BatchKills: 2},
		{Mode: reliability.ModePlain, Lost: 1},
		{Mode: reliability.ModeTx, DeadLettered: 1},
		{Mode: reliability.ModeTx, LeftOnQueue: 1},
		{Mode: reliability.ModeTx, UnexpectedExits: 1},
		{Mode: reliability.ModeTx, Faults: []reliability.FaultResult{{Fault: reliability.FaultRabbitMQ}}},
		// SIGSTOPs that made no zombie tested nothing; a zombie that
		// committed after the takeover is a double.
		{Mode: reliability.ModeTx, Faults: []reliability.FaultResult{{Fault: reliability.FaultSIGSTOP, Recovered: true}}, ZombieMisses: 1},
		{Mode: reliability.ModeTx, Faults: []reliability.FaultResult{{Fault: reliability.FaultSIGSTOP, Recovered: true}}, Zombies: 1, ZombieCommits: 1},
	} {
		if err := r.Err(); err == nil {
			t.Errorf("%+v: Err is nil, want a failure", r)
		}
	}
	err := (reliability.Result{Mode: reliability.ModeTx, Lost: 2, Duplicated: 1}).Err()
	if err == nil || !strings.Contains(err.Error(), "2 messages lost") || !strings.Contains(err.Error(), "1 messages have more than one effect") {
		t.Errorf("Err = %v, want it to name the loss and the double", err)
	}
}
