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
	at         time.Time
	self, busy time.Duration
	// broker and db are the processor times of those processes, by pid:
	// a window counts each process's own growth, so that one exiting
	// during the window (a database connection closed) takes nothing away.
	broker, db map[int]time.Duration
}

// clockTick is USER_HZ, the unit of /proc's CPU times: 100 on Linux for
// every architecture Go supports.
const clockTick = 10 * time.Millisecond

// snapCPU reads /proc. Processes that are not readable are not counted, nor
// what a process that exited during the window spent in it; the database's
// connections of a bench cell live through it. The database and broker
// columns count every process of those servers, other clients' connections
// included. Zero values where /proc is missing.
func snapCPU() cpuSnap {
	s := cpuSnap{at: time.Now(), broker: map[int]time.Duration{}, db: map[int]time.Duration{}}
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
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		switch {
		case filepath.Base(filepath.Dir(path)) == self:
			s.self += t
		case comm == "beam.smp" || comm == "nats-server" || comm == "redis-server":
			s.broker[pid] = t
		case comm == "postgres" || comm == "mariadbd" || comm == "mysqld":
			s.db[pid] = t
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
	return cpuUse{Go: e.self - s.self, Broker: grown(s.broker, e.broker), DB: grown(s.db, e.db), Busy: e.busy - s.busy, Wall: e.at.Sub(s.at)}
}

// grown sums what each process of end spent since start: all of it for a
// process that started during the window, nothing for one that exited.
func grown(start, end map[int]time.Duration) time.Duration {
	var d time.Duration
	for pid, t := range end {
		if t > start[pid] {
			d += t - start[pid]
		}
	}
	return d
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
