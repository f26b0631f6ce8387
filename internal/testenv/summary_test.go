package testenv

import (
	"testing"
)

func TestSummary(t *testing.T) {
	for _, tc := range []struct {
		used    map[string]bool
		skipped map[string]int
		want    string
	}{
		{nil, nil, ""},
		{map[string]bool{"RabbitMQ": true, "SQLite": true, "PostgreSQL": true}, nil, "testenv: pkg: used SQLite, PostgreSQL, RabbitMQ; none skipped"},
		{map[string]bool{"SQLite": true}, map[string]int{AMQPURLEnv: 9, "SETTLE_JAEGER_BIN": 2},
			"testenv: pkg: used SQLite; 11 tests skipped: 9 without SETTLE_AMQP_URL, 2 without SETTLE_JAEGER_BIN"},
		{nil, map[string]int{PostgresURLEnv: 1}, "testenv: pkg: used no service; 1 test skipped: 1 without SETTLE_POSTGRES_URL"},
	} {
		if got := summary("pkg", tc.used, tc.skipped); got != tc.want {
			t.Errorf("summary(%v, %v) =\n%q\nwant\n%q", tc.used, tc.skipped, got, tc.want)
		}
	}
}

// Require records what it skipped for, and what it found.
func TestRequireRecords(t *testing.T) {
	t.Setenv(RequireEnv, "")
	t.Setenv("SETTLE_TESTENV_SET", "x")
	const unset = "SETTLE_TESTENV_NEVER_SET"
	t.Run("skipped", func(t *testing.T) { Require(t, unset) })
	t.Run("used", func(t *testing.T) { Require(t, "SETTLE_TESTENV_SET") })
	record.Lock()
	defer record.Unlock()
	if record.skipped[unset] != 1 || !record.used["SETTLE_TESTENV_SET"] {
		t.Fatalf("record: skipped %v, used %v", record.skipped, record.used)
	}
	delete(record.skipped, unset)
	delete(record.used, "SETTLE_TESTENV_SET")
}
