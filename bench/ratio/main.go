// Command ratio reads `go test -bench ClaimConfirm` output on stdin and prints
// a Markdown table of the median msgs/s of settle and of the raw-SQL floor for
// each store and concurrency, and their ratio settle/floor.
//
// Benchmark names must look like
//
//	BenchmarkClaimConfirm/<store>/g=<n>/<settle|floor>-<procs>
//	BenchmarkClaimConfirm/<store>/g=<n>-<procs>            (no floor, e.g. memory)
//
// Lines without a msgs/s metric are ignored.
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
)

func main() {
	rows, err := parse(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ratio:", err)
		os.Exit(1)
	}
	if len(rows) == 0 {
		fmt.Fprintln(os.Stderr, "ratio: no benchmark lines with msgs/s on stdin")
		os.Exit(1)
	}
	fmt.Print(format(rows))
}

// row is one store at one concurrency.
type row struct {
	store  string
	g      int
	settle []float64
	floor  []float64
}

// parse collects the msgs/s samples of every store and concurrency, in the
// order they first appear.
func parse(r io.Reader) ([]*row, error) {
	var rows []*row
	index := map[string]*row{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || !strings.HasPrefix(fields[0], "Benchmark") {
			continue
		}
		v, ok := metric(fields, "msgs/s")
		if !ok {
			continue
		}
		name := fields[0]
		if i := strings.LastIndexByte(name, '-'); i > 0 {
			if _, err := strconv.Atoi(name[i+1:]); err == nil {
				name = name[:i] // drop the -GOMAXPROCS suffix
			}
		}
		parts := strings.Split(name, "/")
		if len(parts) < 3 || !strings.HasPrefix(parts[2], "g=") {
			return nil, fmt.Errorf("unexpected benchmark name %q", fields[0])
		}
		g, err := strconv.Atoi(strings.TrimPrefix(parts[2], "g="))
		if err != nil {
			return nil, fmt.Errorf("benchmark %q: %w", fields[0], err)
		}
		variant := "settle"
		if len(parts) > 3 {
			variant = parts[3]
		}
		id := parts[1] + "/" + parts[2]
		rw := index[id]
		if rw == nil {
			rw = &row{store: parts[1], g: g}
			index[id] = rw
			rows = append(rows, rw)
		}
		switch variant {
		case "settle":
			rw.settle = append(rw.settle, v)
		case "floor":
			rw.floor = append(rw.floor, v)
		default:
			return nil, fmt.Errorf("benchmark %q: unknown variant %q", fields[0], variant)
		}
	}
	return rows, sc.Err()
}

// metric returns the value printed before unit in a benchmark line.
func metric(fields []string, unit string) (float64, bool) {
	for i := 2; i < len(fields); i++ {
		if fields[i] == unit {
			v, err := strconv.ParseFloat(fields[i-1], 64)
			return v, err == nil
		}
	}
	return 0, false
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func format(rows []*row) string {
	var b strings.Builder
	b.WriteString("| store | goroutines | settle msgs/s | floor msgs/s | settle/floor | runs |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		settle, floor, ratio := "–", "–", "–"
		if len(r.settle) > 0 {
			settle = strconv.FormatFloat(median(r.settle), 'f', 0, 64)
		}
		if len(r.floor) > 0 {
			floor = strconv.FormatFloat(median(r.floor), 'f', 0, 64)
		}
		if len(r.settle) > 0 && len(r.floor) > 0 {
			ratio = strconv.FormatFloat(median(r.settle)/median(r.floor), 'f', 2, 64)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %d |\n", r.store, r.g, settle, floor, ratio, len(r.settle))
	}
	return b.String()
}
