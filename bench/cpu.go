package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// cpuUse is the processor time spent during a window, by whom: this
// process (settle and the clients), the brokers (RabbitMQ's beam.smp,
// nats-server and redis-server, all three, whichever is in use), the
// database server (postgres, mariadbd/mysqld processes), and the machine as
// a whole (busy time over all cores, and the window's length).
type cpuUse struct {
	Go, Broker, DB, Busy, Wall time.Duration
}

type cpuSnap struct {
	at                     time.Time
	self, broker, db, busy time.Duration
}

// clockTick is USER_HZ, the unit of /proc's CPU times: 100 on Linux for
// every architecture Go supports.
const clockTick = 10 * time.Millisecond

// snapCPU reads /proc. Processes that are not readable, or that exited
// during the window, are not counted; the database's connections of a
// bench cell live through it. Zero values where /proc is missing.
func snapCPU() cpuSnap {
	s := cpuSnap{at: time.Now()}
	self := strconv.Itoa(os.Getpid())
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		open, closing := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
		if open < 0 || closing < open {
			continue
		}
		comm := string(b[open+1 : closing])
		f := strings.Fields(string(b[closing+1:]))
		if len(f) < 13 {
			continue
		}
		// Fields after the command: state is f[0], utime f[11], stime f[12].
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		t := time.Duration(ut+st) * clockTick
		switch {
		case filepath.Base(filepath.Dir(path)) == self:
			s.self += t
		case comm == "beam.smp" || comm == "nats-server" || comm == "redis-server":
			s.broker += t
		case comm == "postgres" || comm == "mariadbd" || comm == "mysqld":
			s.db += t
		}
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		// cpu user nice system idle iowait irq softirq steal ...
		for i, v := range f[1:] {
			if i == 3 || i == 4 || i >= 8 {
				continue // idle, iowait, guest time (counted in user)
			}
			n, _ := strconv.ParseInt(v, 10, 64)
			s.busy += time.Duration(n) * clockTick
		}
	}
	return s
}

func (s cpuSnap) until(e cpuSnap) cpuUse {
	return cpuUse{Go: e.self - s.self, Broker: e.broker - s.broker, DB: e.db - s.db, Busy: e.busy - s.busy, Wall: e.at.Sub(s.at)}
}

// perK is c spread over n messages: milliseconds of each per 1,000.
func (c cpuUse) perK(n int) CPUPerK {
	k := float64(n) / 1000
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / k }
	return CPUPerK{Go: ms(c.Go), Broker: ms(c.Broker), DB: ms(c.DB), Busy: ms(c.Busy)}
}

// CPUPerK is processor time per 1,000 messages, in milliseconds: this
// process, the broker, the database server, and the whole machine.
type CPUPerK struct {
	Go     float64 `json:"go_ms"`
	Broker float64 `json:"broker_ms"`
	DB     float64 `json:"db_ms"`
	Busy   float64 `json:"machine_ms"`
}
