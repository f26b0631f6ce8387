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
	"github.com/settle-go/settle/parked"
)

// serveConsole runs settle console with args on the database of p and
// returns its base URL; it stops when the test ends.
func serveConsole(t *testing.T, p *parkedEnv, args ...string) string {
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
	base := serveConsole(t, p)
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
	resp, body = do(http.MethodGet, "/confirm?action=archive&id="+sid, evil, nil)
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
