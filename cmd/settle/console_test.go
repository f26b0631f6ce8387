package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
)

// Without a token the console listens on loopback only: any other address
// is refused before the database is opened.
func TestConsoleRefusesOpenAddressWithoutToken(t *testing.T) {
	t.Parallel()
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0"} {
		r := runCmd(t.Context(), nil, "console", "-addr", addr, "-db", "postgres://user:hunter2@db.invalid/x")
		if r.code != exitUsage || !strings.Contains(r.stderr, "without a token") {
			t.Errorf("console -addr %s without a token: want exit 2 saying why, got\n%v", addr, r)
		}
		if strings.Contains(r.stdout+r.stderr, "hunter2") {
			t.Errorf("the output shows the password:\n%v", r)
		}
	}
	r := runCmd(t.Context(), map[string]string{consoleTokenEnv: "short"}, "console", "-addr", "127.0.0.1:0")
	if r.code != exitUsage || !strings.Contains(r.stderr, "16 bytes") {
		t.Errorf("a short token: want exit 2, got\n%v", r)
	}
}

// settle console serves the console of a database until interrupted, with
// the token of its file, which it never prints.
func TestConsoleServes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	url := "sqlite://" + filepath.Join(dir, "app.db")
	if err := os.WriteFile(filepath.Join(dir, "app.db"), nil, 0o600); err != nil { // an empty file is an empty database
		t.Fatal(err)
	}
	d, err := openDatabase(&env{ctx: t.Context(), getenv: func(string) string { return "" }}, url, driverAuto)
	if err != nil {
		t.Fatal(err)
	}
	ddl := schemaOf(t)
	for _, q := range ddl {
		if _, err := d.pool.Exec(t.Context(), q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	_ = d.Close()
	const token = "cmd-token-0123456789abcdef"
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(t.Context())
	outR, outW := io.Pipe()
	var errOut strings.Builder
	done := make(chan int, 1)
	go func() {
		code := runEnv(&env{ctx: ctx, stdout: outW, stderr: &errOut, getenv: func(string) string { return "" }},
			[]string{"console", "-db", url, "-addr", "127.0.0.1:0", "-token-file", tokenFile, "-read-only"})
		_ = outW.Close()
		done <- code
	}()
	line, err := bufio.NewReader(outR).ReadString('\n')
	if err != nil {
		cancel()
		t.Fatalf("no line from settle console: %v (exit %d, stderr %s)", err, <-done, errOut.String())
	}
	go func() { _, _ = io.Copy(io.Discard, outR) }()
	base := regexp.MustCompile(`http://127\.0\.0\.1:\d+`).FindString(line)
	if base == "" || strings.Contains(line, token) || !strings.Contains(line, "read-only") {
		t.Errorf("the first line %q: want the address, read-only, and no token", line)
	}
	for _, tc := range []struct {
		auth string
		want int
	}{{"", http.StatusUnauthorized}, {"Bearer " + token, http.StatusOK}} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, base+"/", nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("GET / with %q: %s, want %d", tc.auth, resp.Status, tc.want)
		}
	}
	cancel()
	if code := <-done; code != exitOK {
		t.Errorf("settle console exited %d after the interrupt; stderr:\n%s", code, errOut.String())
	}
	if strings.Contains(errOut.String(), token) {
		t.Error("stderr shows the token")
	}
}

// schemaOf is the DDL of the tables settle console needs, on SQLite.
func schemaOf(t *testing.T) []string {
	t.Helper()
	drv := testenv.SQLite(t).Driver()
	ps, err := parked.New(drv, parked.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	dd, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return append(append(ps.Schema(), ob.Schema()...), dd.Schema()...)
}
