package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// OutboxResults: section outbox, the table printed by ./outbox.
type OutboxResults struct {
	Args  []string `json:"args"`
	Title string   `json:"title"` // its first line: server, n, poll, runs
	Table string   `json:"table"` // markdown
}

// runOutbox runs the outbox benchmark as its own command (./outbox keeps
// its flags and its own documentation) and keeps the table it prints.
func runOutbox(ctx context.Context, o options, log io.Writer) (*OutboxResults, error) {
	args := []string{"-broker", "gochannel,amqp", "-amqp-pool", "4", "-poll", "10ms",
		"-n", "5000", "-runs", strconv.Itoa(o.runs), "-paced", "5s", "-rate", "1000",
		"-scenarios", "direct,forward,paced,prefilled,lag", "-idle", "5s"}
	if o.quick {
		args = []string{"-broker", "gochannel,amqp", "-amqp-pool", "4", "-poll", "10ms",
			"-n", "1000", "-runs", strconv.Itoa(o.runs), "-paced", "2s", "-rate", "1000",
			"-scenarios", "direct,forward,paced,prefilled,lag", "-idle", "5s"}
	}
	cmd := exec.CommandContext(ctx, "go", append([]string{"run", "./outbox"}, args...)...)
	cmd.Env = append(os.Environ(), "SETTLE_POSTGRES_URL="+o.pgURL, "SETTLE_AMQP_URL="+o.amqpURL)
	var out bytes.Buffer
	cmd.Stdout = io.MultiWriter(&out, log)
	cmd.Stderr = log
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("go run ./outbox: %w", err)
	}
	title, table, _ := strings.Cut(strings.TrimSpace(out.String()), "\n")
	if !strings.Contains(table, "| broker |") {
		return nil, fmt.Errorf("./outbox printed no table:\n%s", out.String())
	}
	return &OutboxResults{Args: args, Title: strings.TrimSpace(title), Table: strings.TrimSpace(table) + "\n"}, nil
}
