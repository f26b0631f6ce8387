package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseStoreBench(t *testing.T) {
	t.Parallel()
	out := `goos: linux
BenchmarkClaimConfirm/memory/g=1-2         	 1000000	      1000 ns/op	   1000000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2	    5000	    250000 ns/op	      4000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/floor-2 	    5000	    200000 ns/op	      5000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2	    5000	    250000 ns/op	      3000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2	    5000	    250000 ns/op	      3800 msgs/s
PASS
`
	rows, err := parseStoreBench(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	want := []StoreRow{
		{Store: "memory", Goroutines: 1, Settle: 1000000},
		{Store: "postgres", Goroutines: 4, Settle: 3800, Floor: 5000},
	}
	if len(rows) != len(want) {
		t.Fatalf("got %d rows %+v, want %+v", len(rows), rows, want)
	}
	for i := range want {
		if rows[i] != want[i] {
			t.Errorf("row %d: got %+v, want %+v", i, rows[i], want[i])
		}
	}
}

func TestParseStoreBenchRefusesEmptyOutput(t *testing.T) {
	t.Parallel()
	if _, err := parseStoreBench(strings.NewReader("FAIL\n")); err == nil {
		t.Fatal("no error for output without benchmark lines")
	}
}

func TestNum(t *testing.T) {
	t.Parallel()
	for in, want := range map[float64]string{0: "0", 999: "999", 1000: "1,000", 1234567.4: "1,234,567", -4200: "-4,200"} {
		if got := num(in); got != want {
			t.Errorf("num(%v) = %q, want %q", in, got, want)
		}
	}
}

func TestParseFlags(t *testing.T) {
	t.Parallel()
	o, err := parseFlags([]string{"-quick", "-only", "stack,growth"})
	if err != nil {
		t.Fatal(err)
	}
	if !o.quick || o.runs != 1 || !o.only["stack"] || !o.only["growth"] || o.only["amqp"] {
		t.Errorf("parsed %+v", o)
	}
	if _, err := parseFlags([]string{"-only", "nope"}); err == nil {
		t.Error("unknown section accepted")
	}
}

func TestRenderDocWithoutResults(t *testing.T) {
	t.Parallel()
	doc, err := renderDoc(&Results{Runs: map[string]RunAt{}})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"# Benchmarks", "## 3. Dedupe stores", "(not measured)"} {
		if !strings.Contains(doc, s) {
			t.Errorf("document lacks %q", s)
		}
	}
}

func TestCheckDir(t *testing.T) {
	// Not parallel: t.Chdir changes the process's directory.
	if err := checkDir(); err != nil {
		t.Fatalf("in the harness's own directory: %v", err)
	}
	// settleDir is settle's module, where the stores section runs settle's
	// dedupe benchmarks.
	b, err := os.ReadFile(filepath.Join(settleDir, "go.mod"))
	if err != nil || !strings.HasPrefix(string(b), "module github.com/settle-go/settle\n") {
		t.Fatalf("%s/go.mod is not settle's (err %v)", settleDir, err)
	}
	if _, err := os.Stat(filepath.Join(settleDir, "dedupe", "bench_test.go")); err != nil {
		t.Fatalf("the stores section's benchmarks: %v", err)
	}
	t.Chdir(settleDir)
	if err := checkDir(); err == nil {
		t.Fatal("checkDir accepted settle's root directory")
	}
}

// A process that exits during a window (a database connection closed)
// takes nothing away from it; one that started during it counts in full.
func TestCPUGrownPerProcess(t *testing.T) {
	start := map[int]time.Duration{1: 5 * time.Second, 2: 3 * time.Second}
	end := map[int]time.Duration{1: 6 * time.Second, 3: time.Second}
	if got := grown(start, end); got != 2*time.Second {
		t.Errorf("grown = %s, want 2s (1s of pid 1, 1s of the new pid 3, nothing of the exited pid 2)", got)
	}
}

func TestAnchorsRoundsRotateAndSummary(t *testing.T) {
	t.Parallel()
	if got := strings.Join(rotate([]string{"a", "b", "c"}, 4), ","); got != "b,c,a" {
		t.Errorf("rotate by 4 = %s, want b,c,a", got)
	}
	row := AnchorsRow{DB: "postgres", Rate: map[string]float64{}, Rates: map[string][]float64{},
		AddedP50: map[string][]float64{ancGroup: {1, 3}, ancBatch: {0.5, 0.7}}}
	for c, rs := range map[string][]float64{ancRaw: {1000, 2000}, ancRawOne: {1000, 1000}, ancHand: {100, 200}, ancDefault: {120, 180}, ancOne: {150, 220}, ancGroup: {500, 700}, ancBatch: {900, 800}} {
		row.Rates[c], row.Rate[c] = rs, median(append([]float64(nil), rs...))
	}
	var b strings.Builder
	anchorsSummary(&b, &AnchorsResults{LatencyRate: 500, Rows: []AnchorsRow{row}}, func(r, t float64) string {
		if r >= t {
			return "yes"
		}
		return "no"
	})
	for _, want := range []string{
		"settle-default | 150 msgs/s | 150 msgs/s (hand-written, same rounds; per round 0.90x–1.20x) | 1.00x | 1.00x | yes |",
		"settle-one | 185 msgs/s | 150 msgs/s (hand-written, same rounds; per round 1.10x–1.50x) | 1.23x | 1.20x | yes |",
		"settle-batch-handler | 850 msgs/s | 1,000 msgs/s (raw-consume-amqpsub, same rounds; per round 0.80x–0.90x) | 0.85x | 0.80x | yes |",
		"settle-group | 600 msgs/s | 1,500 msgs/s (raw-consume, same rounds; per round 0.35x–0.50x) | 0.40x | 0.60x | no |",
		"settle-group at 500 msgs/s, latency added at p50 | 2.00 ms |",
		"settle-batch-handler at 500 msgs/s, latency added at p50 | 0.60 ms |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, b.String())
		}
	}
}
