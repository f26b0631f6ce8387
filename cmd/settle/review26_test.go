package main

// An outside review of settle console (issue 26): a real listener on
// 127.0.0.1 over a SQLite file.

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/parked"
)

// serveReviewConsole runs settle console with args on the database of p and
// returns its base URL; it stops when the test ends.
func serveReviewConsole(t *testing.T, p *parkedEnv, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	outR, outW := io.Pipe()
	var errOut strings.Builder
	done := make(chan int, 1)
	args = append([]string{"console", "-db", p.url, "-table", p.table, "-topic", p.outbox, "-dedupe-table", "", "-addr", "127.0.0.1:0"}, args...)
	go func() {
		code := runEnv(&env{ctx: ctx, stdout: outW, stderr: &errOut, getenv: func(string) string { return "" }}, args)
		_ = outW.Close()
		done <- code
	}()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != exitOK {
			t.Errorf("settle console exited %d; stderr:\n%s", code, errOut.String())
		}
	})
	line, err := bufio.NewReader(outR).ReadString('\n')
	if err != nil {
		t.Fatalf("no line from settle console: %v", err)
	}
	go func() { _, _ = io.Copy(io.Discard, outR) }()
	base := regexp.MustCompile(`http://127\.0\.0\.1:\d+`).FindString(line)
	if base == "" {
		t.Fatalf("no address in %q", line)
	}
	return base
}

// DNS rebinding: a page of evil.test, whose name the attacker then points
// at 127.0.0.1, is of the same origin as its own requests to the console:
// Host and Origin both say evil.test:PORT, the browser keeps the console's
// cookie for evil.test, and the page reads the CSRF token of the form. A
// console without a token listens on loopback so that only this machine's
// users reach it; any web page its operator opens must not. It must serve
// only requests addressed to a loopback name.
func TestReview26ConsoleWithoutTokenRefusesForeignHost(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "app.db")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	p := setupParked(t, "sqlite://"+file, nil)
	p.park("u-rebind", "charge", "orders", settle.DeadLettered, "card declined", time.Now(), `{"card":"4111"}`, nil)
	id := p.idOf("u-rebind")
	base := serveReviewConsole(t, p)
	port := base[strings.LastIndex(base, ":")+1:]
	evil := "evil.test:" + port

	jar := map[string]string{} // the rebound page's cookies, for evil.test
	do := func(method, path, host string, form url.Values) (*http.Response, string) {
		t.Helper()
		var body io.Reader
		if form != nil {
			body = strings.NewReader(form.Encode())
		}
		req, _ := http.NewRequestWithContext(t.Context(), method, base+path, body)
		req.Host = host
		if form != nil {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Origin", "http://"+host)
			req.Header.Set("Sec-Fetch-Site", "same-origin")
		}
		for k, v := range jar {
			req.AddCookie(&http.Cookie{Name: k, Value: v})
		}
		resp, err := (&http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, c := range resp.Cookies() {
			jar[c.Name] = c.Value
		}
		return resp, string(b)
	}

	sid := strconv.FormatInt(id, 10)
	resp, body := do(http.MethodGet, "/messages/"+sid, evil, nil)
	if resp.StatusCode == http.StatusOK || strings.Contains(body, "4111") {
		t.Errorf("GET with Host %s: %s, the payload shown: %v", evil, resp.Status, strings.Contains(body, "4111"))
	}
	_, body = do(http.MethodGet, "/confirm?action=archive&id="+sid, evil, nil)
	if m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(body); m != nil {
		resp, _ = do(http.MethodPost, "/act", evil, url.Values{"csrf": {m[1]}, "action": {"archive"}, "id": {sid}})
		t.Logf("POST /act with Host %s: %s", evil, resp.Status)
	}
	if st := p.states()["u-rebind"]; st != parked.StateParked {
		t.Errorf("a rebound page archived the message: %s", st)
	}

	// The console's own names still work.
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LOCALHOST:" + port} {
		if resp, _ := do(http.MethodGet, "/", host, nil); resp.StatusCode != http.StatusOK {
			t.Errorf("GET / with Host %s: %s", host, resp.Status)
		}
	}
}

// A hostile row (OSC 8 hyperlinks, a window title, bidi overrides, C1
// controls, bytes that are not UTF-8, in every field and in a metadata
// key) prints inert in list, groups, show, and the claims of dedupe show
// and inflight.
func TestReview26HostileRowPrintsInert(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "app.db")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	p := setupParked(t, "sqlite://"+file, nil)
	const x = "\x1b]8;;http://evil.test/\x1b\\click\x1b]8;;\x1b\\\x1b]0;pwned\x07\u202eevil\u2066\u009b31m\xff\xc0"
	p.park("u"+x, "h"+x, "t"+x, settle.Poisoned, "reason"+x+"\nline2"+x, time.Now(), `{"k`+x+`":"v`+x+`"}`, map[string]string{"m" + x: "v" + x})
	p.park("u2", "h2", "t2", settle.DeadLettered, "r", time.Now(), "text"+x, nil)
	var ids []string
	for u := range p.states() {
		ids = append(ids, strconv.FormatInt(p.idOf(u), 10))
	}
	outs := map[string]string{}
	r := p.run(exitOK, "parked list")
	outs["list"] = r.stdout + r.stderr
	r = p.run(exitOK, "parked list", "-handler", "h"+x)
	outs["list -handler"] = r.stdout + r.stderr
	r = p.run(exitOK, "parked groups")
	outs["groups"] = r.stdout + r.stderr
	for _, id := range ids {
		r = p.run(exitOK, "parked show", id)
		outs["show "+id] = r.stdout + r.stderr
	}
	r = p.run(exitOK, "parked replay", "-all")
	outs["replay dry run"] = r.stdout + r.stderr
	r = p.run(exitOK, "parked replay", "-all", "-to", "to"+x)
	outs["replay -to dry run"] = r.stdout + r.stderr
	for what, out := range outs {
		assertSafe(t, what, out)
		if strings.Contains(out, "\x1b") {
			t.Errorf("%s prints ESC raw", what)
		}
	}
	// Without -yes nothing changes: rows and outbox.
	p.run(exitOK, "parked archive", "-all")
	p.run(exitOK, "parked purge", "-before", "0s", "-state", "parked")
	p.run(exitOK, "parked replay", "-all", "-force")
	for u, st := range p.states() {
		if st != parked.StateParked {
			t.Errorf("%q is %s after dry runs", u, st)
		}
	}
	if len(p.states()) != 2 {
		t.Errorf("%d rows after dry runs, want 2", len(p.states()))
	}
	if n, _ := p.outboxRows(); len(n) != 0 {
		t.Errorf("dry runs wrote %d outbox rows", len(n))
	}
}

// parked show of a small, deeply nested JSON payload does not print (nor
// build in memory) depth × values bytes of indentation: 44 KB would print
// about 80 MB, 1 MiB gigabytes.
func TestReview26ShowNestedJSONPayloadIsNotABomb(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "app.db")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	p := setupParked(t, "sqlite://"+file, nil)
	const depth, values = 2000, 20000
	payload := strings.Repeat("[", depth) + strings.Repeat("0,", values-1) + "0" + strings.Repeat("]", depth)
	p.park("u-deep", "h", "t", settle.Poisoned, "r", time.Now(), payload, nil)
	r := p.run(exitOK, "parked show", strconv.FormatInt(p.idOf("u-deep"), 10))
	if len(r.stdout) > 16*len(payload)+1<<20 {
		t.Errorf("parked show of a %d-byte payload printed %d MiB", len(payload), len(r.stdout)>>20)
	}
	if !strings.Contains(r.stdout, "payload (") || !strings.Contains(r.stdout, "0,0,0") && !strings.Contains(r.stdout, "0,\n") {
		t.Errorf("the payload is not shown:\n%.2000s", r.stdout)
	}
}

// A password in -db shows in no error: a host that does not answer, a
// table that does not exist, a driver that does not fit, and settle
// console's checks of its tables.
func TestReview26PasswordInNoError(t *testing.T) {
	t.Parallel()
	pg := testenv.Require(t, testenv.PostgresURLEnv)
	u, err := url.Parse(pg)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), "hunter2-s3cret") // trust authentication ignores it
	withPw := u.String()
	for _, args := range [][]string{
		{"parked", "list", "-db", "postgres://u:hunter2-s3cret@127.0.0.1:1/x"},
		{"parked", "show", "1", "-db", "postgres://u:hunter2-s3cret@127.0.0.1:1/x", "-driver", "sql"},
		{"parked", "list", "-db", withPw, "-table", "no_such_table_review26"},
		{"parked", "groups", "-db", withPw, "-table", "no_such_table_review26", "-driver", "sql"},
		{"parked", "replay", "-all", "-db", withPw, "-table", "no_such_table_review26", "-yes"},
		{"parked", "archive", "-all", "-db", withPw, "-table", "no_such_table_review26", "-yes"},
		{"parked", "purge", "-before", "1d", "-db", withPw, "-table", "no_such_table_review26", "-yes"},
		{"dedupe", "show", "-db", withPw, "-table", "no_such_table_review26", "-handler", "h", "-key", "k"},
		{"dedupe", "inflight", "-db", withPw, "-table", "no_such_table_review26"},
		{"dedupe", "inflight", "-db", "mysql://root:hunter2-s3cret@127.0.0.1:1/x", "-driver", "pgx"},
		{"console", "-db", withPw, "-table", "no_such_table_review26"},
		{"console", "-db", "postgres://u:hunter2-s3cret@127.0.0.1:1/x"},
		{"parked", "list", "-db", "postgres://u:hunter2-s3cret@127.0.0.1:1/x?sslmode=bogus"},
		{"parked", "list", "-db", "postgres://u:hunter2-s3cret@[::1/x"},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		r := runCmd(ctx, nil, args...)
		cancel()
		if r.code == exitOK {
			t.Errorf("%v: exit 0", args)
		}
		if strings.Contains(r.stdout+r.stderr, "hunter2") {
			t.Errorf("%v shows the password:\n%v", args, r)
		}
	}
}
