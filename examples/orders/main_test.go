package main

import (
	"bytes"
	"regexp"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRunChargesEachOrderOnce(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 12}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	want := map[string]string{
		"orders placed":            `12`,
		"charges applied":          `12`,
		"duplicates absorbed":      `12`,
		"failed runs, redelivered": `4`, // orders 3, 6, 9 and 12 fail once
	}
	for label, n := range want {
		re := regexp.MustCompile(regexp.QuoteMeta(label) + `\s+` + n + `\s*\n`)
		if !re.Match(out.Bytes()) {
			t.Errorf("output lacks %q = %s:\n%s", label, n, out.String())
		}
	}
	if !bytes.Contains(out.Bytes(), []byte("every order charged exactly once")) {
		t.Errorf("output lacks the closing line:\n%s", out.String())
	}
}

func TestRunRefusesBadFlags(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), config{Orders: 0}, &out); err == nil {
		t.Fatal("run with -orders 0 succeeded")
	}
	if err := run(t.Context(), config{Orders: 1, DB: "oracle://x"}, &out); err == nil {
		t.Fatal("run with an unsupported database URL succeeded")
	}
}
