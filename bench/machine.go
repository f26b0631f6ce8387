package main

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/internal/sqlurl"
)

// Machine describes where the figures were taken; no paths, no host names.
type Machine struct {
	CPUs       int    `json:"cpus"`
	CPUModel   string `json:"cpu_model"`
	Go         string `json:"go"`
	Postgres   string `json:"postgres"`
	MariaDB    string `json:"mariadb"`
	SQLite     string `json:"sqlite"`
	RabbitMQ   string `json:"rabbitmq"`
	PGSyncMode string `json:"pg_synchronous_commit"`
}

func (m Machine) String() string {
	return fmt.Sprintf("%d CPUs (%s), %s; PostgreSQL %s (synchronous_commit=%s), MariaDB %s, SQLite %s, RabbitMQ %s",
		m.CPUs, m.CPUModel, m.Go, m.Postgres, m.PGSyncMode, m.MariaDB, m.SQLite, m.RabbitMQ)
}

func describeMachine(ctx context.Context, o options) Machine {
	m := Machine{CPUs: runtime.NumCPU(), CPUModel: cpuModel(), Go: runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	query := func(url, q string, dst ...*string) {
		db, _, err := sqlurl.Open(url)
		if err != nil {
			return
		}
		defer db.Close()
		args := make([]any, len(dst))
		for i := range dst {
			args[i] = dst[i]
		}
		_ = db.QueryRowContext(ctx, q).Scan(args...)
	}
	query(o.pgURL, "SELECT current_setting('server_version'), current_setting('synchronous_commit')", &m.Postgres, &m.PGSyncMode)
	query(o.mysqlURL, "SELECT VERSION()", &m.MariaDB)
	if db, err := sql.Open("sqlite", ":memory:"); err == nil {
		_ = db.QueryRowContext(ctx, "SELECT sqlite_version()").Scan(&m.SQLite)
		_ = db.Close()
	}
	if c, err := amqp091.Dial(o.amqpURL); err == nil {
		if v, ok := c.Properties["version"].(string); ok {
			m.RabbitMQ = v
		}
		_ = c.Close()
	}
	return m
}

func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// loadAvg is the 1-minute load average (0 where /proc/loadavg is missing).
func loadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	l, _ := strconv.ParseFloat(f[0], 64)
	return l
}
