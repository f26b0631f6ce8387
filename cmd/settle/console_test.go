package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
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
// the token of its file, which it never prints; without a token, to
// loopback host names only.
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
	t.Run("token", func(t *testing.T) {
		serveConsole(t, []string{"-db", url, "-token-file", tokenFile, "-read-only"}, token, []request{
			{"", "", http.StatusUnauthorized}, {"", "Bearer " + token, http.StatusOK},
			{"evil.test", "Bearer " + token, http.StatusOK}, // the token, not the name, lets it in
		})
	})
	t.Run("no token", func(t *testing.T) {
		serveConsole(t, []string{"-db", url}, token, []request{
			{"", "", http.StatusOK}, {"localhost", "", http.StatusOK}, {"evil.test", "", http.StatusMisdirectedRequest},
		})
	})
}

// request is a request to a console and the status it must get.
type request struct {
	host, auth string
	want       int
}

// serveConsole runs settle console with args on 127.0.0.1, sends it the
// requests, and interrupts it. secret must not be printed.
func serveConsole(t *testing.T, args []string, secret string, reqs []request) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	outR, outW := io.Pipe()
	var errOut strings.Builder
	done := make(chan int, 1)
	go func() {
		code := runEnv(&env{ctx: ctx, stdout: outW, stderr: &errOut, getenv: func(string) string { return "" }},
			append([]string{"console", "-addr", "127.0.0.1:0"}, args...))
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
	if base == "" || strings.Contains(line, secret) {
		t.Errorf("the first line %q: want the address, and no token", line)
	}
	for _, tc := range reqs {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, base+"/", nil)
		if tc.host != "" {
			req.Host = tc.host
		}
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("GET / (Host %q, Authorization %q): %s, want %d", tc.host, tc.auth, resp.Status, tc.want)
		}
	}
	cancel()
	if code := <-done; code != exitOK {
		t.Errorf("settle console exited %d after the interrupt; stderr:\n%s", code, errOut.String())
	}
	if strings.Contains(errOut.String(), secret) {
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

// Without a token, a request under another host name (DNS rebinding: a
// site whose name resolves to 127.0.0.1) is refused.
func TestConsoleLoopbackHostOnly(t *testing.T) {
	t.Parallel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})
	h := loopbackOnly(ok)
	for host, want := range map[string]int{
		"127.0.0.1:8080": 200, "localhost:8080": 200, "LOCALHOST": 200, "[::1]:8080": 200, "127.3.4.5": 200,
		"evil.test:8080": 421, "evil.test": 421, "10.0.0.1:8080": 421, "": 421, "localhost.evil.test": 421,
	} {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.Host = host
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != want {
			t.Errorf("Host %q: %d, want %d", host, rec.Code, want)
		}
	}
}
