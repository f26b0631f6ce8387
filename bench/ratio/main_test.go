package main

import (
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const sample = `goos: linux
pkg: github.com/settle-go/settle/dedupe
BenchmarkClaimConfirm/memory/g=1-2     	 1241276	       939.7 ns/op	   1064126 msgs/s
BenchmarkClaimConfirm/memory/g=1-2     	 1241276	       939.7 ns/op	   1000000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2       	    5569	    224467 ns/op	      4000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/floor-2        	    6672	    170125 ns/op	      5000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2       	    5569	    224467 ns/op	      4500 msgs/s
BenchmarkClaimConfirm/postgres/g=4/floor-2        	    6672	    170125 ns/op	      4000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/settle-2       	    5569	    224467 ns/op	      9000 msgs/s
BenchmarkClaimConfirm/postgres/g=4/floor-2        	    6672	    170125 ns/op	      6000 msgs/s
--- FAIL: BenchmarkOther
PASS
`

func TestParseAndFormat(t *testing.T) {
	t.Parallel()
	rows, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	got := format(rows)
	want := "| store | goroutines | settle msgs/s | floor msgs/s | settle/floor | runs |\n" +
		"|---|---:|---:|---:|---:|---:|\n" +
		"| memory | 1 | 1032063 | – | – | 2 |\n" +
		"| postgres | 4 | 4500 | 5000 | 0.90 | 3 |\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

func TestParseRejectsUnknownNames(t *testing.T) {
	t.Parallel()
	for _, line := range []string{
		"BenchmarkClaimConfirm/postgres-2 10 1 ns/op 5 msgs/s",
		"BenchmarkClaimConfirm/postgres/g=x/settle-2 10 1 ns/op 5 msgs/s",
		"BenchmarkClaimConfirm/postgres/g=1/other-2 10 1 ns/op 5 msgs/s",
	} {
		if _, err := parse(strings.NewReader(line)); err == nil {
			t.Errorf("parse(%q): no error", line)
		}
	}
}
