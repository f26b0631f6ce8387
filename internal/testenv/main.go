package testenv

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

// What the tests of this package's binary used and skipped, for Main's
// summary line. A test binary is one package, so package-level state is
// the per-package record.
var record struct {
	sync.Mutex
	used    map[string]bool
	skipped map[string]int // variable -> tests skipped for lack of it
}

func noteUsed(service string) {
	record.Lock()
	defer record.Unlock()
	if record.used == nil {
		record.used = map[string]bool{}
	}
	record.used[service] = true
}

func noteSkipped(variable string) {
	record.Lock()
	defer record.Unlock()
	if record.skipped == nil {
		record.skipped = map[string]int{}
	}
	record.skipped[variable]++
}

// services are the display names of the variables Require reads.
var services = map[string]string{
	PostgresURLEnv:      "PostgreSQL",
	MySQLURLEnv:         "MySQL",
	AMQPURLEnv:          "RabbitMQ",
	NATSURLEnv:          "NATS",
	RedisURLEnv:         "Redis",
	"SETTLE_JAEGER_BIN": "Jaeger",
}

// Main is TestMain for a package whose tests use real services: it runs the
// tests, checks for leaked goroutines as goleak.VerifyTestMain does (opts are
// goleak's), and writes one line saying which services the tests used and
// how many skipped for lack of which variable, e.g.
//
//	testenv: integration: used SQLite, PostgreSQL; 11 tests skipped: 9 without SETTLE_AMQP_URL, 2 without SETTLE_JAEGER_BIN
//
// go test shows a passing package's output only with -v, so without -v the
// line goes to the terminal (/dev/tty) when there is one; it is not written
// when the package's tests used no service and skipped none.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if line := summary(binaryPackage(), record.used, record.skipped); line != "" {
		if w, closeW := summaryOutput(); w != nil {
			fmt.Fprintln(w, line)
			closeW()
		}
	}
	if code == 0 {
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// binaryPackage is the package name of the running test binary
// ("integration" for integration.test).
func binaryPackage() string {
	return strings.TrimSuffix(strings.TrimSuffix(filepath.Base(os.Args[0]), ".exe"), ".test")
}

func summaryOutput() (io.Writer, func()) {
	if testing.Verbose() {
		return os.Stdout, func() {}
	}
	tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0)
	if err != nil {
		return nil, nil
	}
	return tty, func() { _ = tty.Close() }
}

// summary is Main's line for pkg, or "" when there is nothing to say.
func summary(pkg string, used map[string]bool, skipped map[string]int) string {
	record.Lock()
	defer record.Unlock()
	if len(used) == 0 && len(skipped) == 0 {
		return ""
	}
	var names []string
	for s := range used {
		names = append(names, s)
	}
	order := map[string]int{"SQLite": 0, "PostgreSQL": 1, "MySQL": 2, "RabbitMQ": 3, "Jaeger": 4}
	sort.Slice(names, func(i, j int) bool {
		oi, iok := order[names[i]]
		oj, jok := order[names[j]]
		if iok != jok {
			return iok
		}
		if oi != oj {
			return oi < oj
		}
		return names[i] < names[j]
	})
	var b strings.Builder
	fmt.Fprintf(&b, "testenv: %s: ", pkg)
	if len(names) == 0 {
		b.WriteString("used no service")
	} else {
		b.WriteString("used " + strings.Join(names, ", "))
	}
	total := 0
	var vars []string
	for v, n := range skipped {
		total += n
		vars = append(vars, v)
	}
	if total == 0 {
		b.WriteString("; none skipped")
		return b.String()
	}
	sort.Slice(vars, func(i, j int) bool {
		if skipped[vars[i]] != skipped[vars[j]] {
			return skipped[vars[i]] > skipped[vars[j]]
		}
		return vars[i] < vars[j]
	})
	parts := make([]string, len(vars))
	for i, v := range vars {
		parts[i] = fmt.Sprintf("%d without %s", skipped[v], v)
	}
	fmt.Fprintf(&b, "; %d %s skipped: %s", total, plural(total, "test", "tests"), strings.Join(parts, ", "))
	return b.String()
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
