package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// StoresResults: section stores, from `go test -bench ClaimConfirm ./dedupe`
// run in settle's module.
type StoresResults struct {
	Benchtime string     `json:"benchtime"`
	Count     int        `json:"count"`
	Rows      []StoreRow `json:"rows"`
}

// StoreRow is one store at one concurrency; Floor is 0 for the memory store.
type StoreRow struct {
	Store      string  `json:"store"`
	Goroutines int     `json:"goroutines"`
	Settle     float64 `json:"settle_msgs_per_s"`
	Floor      float64 `json:"floor_msgs_per_s"`
}

func runStores(ctx context.Context, o options, log io.Writer) (*StoresResults, error) {
	res := &StoresResults{Benchtime: "1s", Count: o.runs}
	if o.quick {
		res.Benchtime = "300ms"
	}
	cmd := exec.CommandContext(ctx, "go", "test", "./dedupe/", "-run", "^$", "-bench", "ClaimConfirm",
		"-benchtime", res.Benchtime, "-count", strconv.Itoa(res.Count), "-timeout", "20m")
	cmd.Dir = settleDir // the benchmarks are settle's own tests
	cmd.Env = append(os.Environ(),
		"SETTLE_POSTGRES_URL="+o.pgURL, "SETTLE_MYSQL_URL="+o.mysqlURL, "SETTLE_REQUIRE_INTEGRATION=1")
	cmd.Stderr = log
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	rows, perr := parseStoreBench(io.TeeReader(out, log))
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("go test -bench ClaimConfirm: %w", err)
	}
	if perr != nil {
		return nil, perr
	}
	res.Rows = rows
	return res, nil
}

// parseStoreBench reads lines such as
//
//	BenchmarkClaimConfirm/postgres/g=4/settle-2  5000  250000 ns/op  4000 msgs/s
//	BenchmarkClaimConfirm/memory/g=1-2           ...
//
// and returns the median msgs/s of each store, concurrency and side.
func parseStoreBench(r io.Reader) ([]StoreRow, error) {
	type key struct {
		store string
		g     int
	}
	settle := map[key][]float64{}
	floor := map[key][]float64{}
	var order []key
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "BenchmarkClaimConfirm/") {
			continue
		}
		var rate float64
		for i := 1; i < len(f); i++ {
			if f[i] == "msgs/s" {
				rate, _ = strconv.ParseFloat(f[i-1], 64)
			}
		}
		name := f[0]
		if i := strings.LastIndexByte(name, '-'); i > 0 {
			if _, err := strconv.Atoi(name[i+1:]); err == nil {
				name = name[:i] // the -GOMAXPROCS suffix
			}
		}
		parts := strings.Split(strings.TrimPrefix(name, "BenchmarkClaimConfirm/"), "/")
		if len(parts) < 2 {
			continue
		}
		g, err := strconv.Atoi(strings.TrimPrefix(parts[1], "g="))
		if err != nil {
			return nil, fmt.Errorf("benchmark %s: %w", f[0], err)
		}
		k := key{parts[0], g}
		if _, ok := settle[k]; !ok {
			if _, ok := floor[k]; !ok {
				order = append(order, k)
			}
		}
		if len(parts) == 3 && parts[2] == "floor" {
			floor[k] = append(floor[k], rate)
		} else {
			settle[k] = append(settle[k], rate)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	rows := make([]StoreRow, 0, len(order))
	for _, k := range order {
		rows = append(rows, StoreRow{Store: k.store, Goroutines: k.g, Settle: median(settle[k]), Floor: median(floor[k])})
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("no BenchmarkClaimConfirm results in the output")
	}
	return rows, nil
}
