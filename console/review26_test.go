package console_test

// An outside review of the console (issue 26): black-box attacks on a real
// SQLite store through an httptest server.

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"net/url"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// A small JSON payload nested deep, with many values at the bottom, is
// valid JSON that json.Indent turns into depth × values bytes of spaces:
// 44 KB here would be about 80 MB, and a payload of 1 MiB gigabytes, drawn
// in memory before the page cuts it at 256 KiB. Opening the message must
// not cost more than a few times the page. Not parallel: it measures the
// process's allocations.
func TestReview26NestedJSONPayloadIsNotABomb(t *testing.T) {
	f := setup(t, sqlite(t), nil)
	const depth, values = 2000, 20000
	payload := strings.Repeat("[", depth) + strings.Repeat("0,", values-1) + "0" + strings.Repeat("]", depth)
	id := f.park(t, parkSpec{Handler: "h", Topic: "t", Reason: "r", Payload: payload})
	c := f.client(t)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	body := c.getOK("/messages/" + strconv.FormatInt(id, 10))
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 32<<20 {
		t.Errorf("opening a message of a %d-byte payload allocated %d MiB", len(payload), alloc>>20)
	}
	if len(body) > 1<<20 {
		t.Errorf("the page is %d bytes", len(body))
	}
	if !strings.Contains(body, `id="payload"`) {
		t.Error("the page shows no payload")
	}
}

// Every field of a parked message is attacker-controlled: none may open a
// tag, an attribute or a link on any page that shows it.
func TestReview26HostileFieldsEscapedEverywhere(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) { t.Parallel(); hostileFields(t, sqlite(t)) })
	t.Run("pgx", func(t *testing.T) { t.Parallel(); hostileFields(t, testenv.Pgx(t)) })
}

func hostileFields[TTx any](t *testing.T, db sqldb.Driver[TTx]) {
	f := setup(t, db, func(c *console.Config[TTx]) { c.TraceURL = "http://jaeger.test:16686" })
	const x = `"'><script>alert(1)</script><img src=x onerror=alert(1)>` + "\x00\xff\xc0"
	id := f.park(t, parkSpec{
		UUID:    "uuid" + x,
		Handler: "handler" + x,
		Topic:   "topic" + x,
		Reason:  "reason" + x + "\u202e\x1b]8;;http://evil/\x1b\\",
		Key:     "key" + x,
		TraceID: `javascript:alert(1)//"` + x,
		Payload: `{"a":"</script><script>alert(1)</script>","` + x + `":1}`,
		Meta:    map[string]string{"meta" + x: "value" + x, "traceparent": "00-javascript:alert(1)-00"},
	})
	id2 := f.park(t, parkSpec{Handler: "h2", Topic: "t", Reason: "r", TraceID: `0123456789abcdef0123456789abcde"`})
	c := f.client(t)
	sid := strconv.FormatInt(id, 10)
	pages := []string{
		"/", "/messages", "/messages?state=parked", "/messages/" + sid, "/messages/" + strconv.FormatInt(id2, 10),
		"/confirm?action=replay&id=" + sid, "/confirm?action=archive&id=" + sid,
		"/confirm?action=replay&id=" + sid + "&topic=" + url.QueryEscape("topic"+x),
		"/messages?handler=" + url.QueryEscape(x) + "&reason=" + url.QueryEscape(x),
		"/claims?scope=" + url.QueryEscape(x) + "&key=" + url.QueryEscape(x),
		"/activity?hours=" + url.QueryEscape(x),
	}
	gs, err := f.parked.Groups(t.Context(), parked.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range gs {
		pages = append(pages, "/confirm?action=replay&group="+url.QueryEscape(g.ID), "/messages?group="+url.QueryEscape(g.ID))
	}
	tag := regexp.MustCompile(`(?i)<(script|img)[^>]*>`)
	for _, p := range pages {
		resp, body := c.get(p)
		if resp.StatusCode >= 500 {
			t.Errorf("GET %s: %s", p, resp.Status)
		}
		for _, m := range tag.FindAllString(body, -1) {
			if m != `<script src="/static/console.js" defer>` {
				t.Errorf("GET %s: a tag from a message: %s", p, m)
			}
		}
		if strings.Contains(strings.ToLower(body), `href="javascript`) || strings.Contains(body, "onerror=alert") && !strings.Contains(body, "onerror=alert(1)&gt;") {
			t.Errorf("GET %s: a script link or handler", p)
		}
		if strings.Contains(body, "\x1b") || strings.Contains(body, "\u202e") && p == "/" {
			// The text may hold them (HTML shows them inert); note only.
			t.Logf("GET %s keeps control characters of the reason as text", p)
		}
	}
	if body := c.getOK("/messages/" + sid); strings.Contains(body, `id="trace"`) {
		t.Error("a trace id that is not 32 hex digits is a link")
	}
}

// Every way a POST can come from elsewhere, or without the session's
// token, is refused and changes no row.
func TestReview26CrossSiteActionsRefused(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	id := f.park(t, parkSpec{Handler: "h", Topic: "t", Reason: "r"})
	sid := strconv.FormatInt(id, 10)
	victim := f.client(t)
	form := confirmForm(t, victim.getOK("/confirm?action=archive&id="+sid))
	other := f.client(t)
	otherForm := confirmForm(t, other.getOK("/confirm?action=archive&id="+sid))

	for _, tc := range []struct {
		name   string
		c      *client
		method string
		form   url.Values
		hdr    map[string]string
	}{
		{"no Origin", victim, http.MethodPost, form, map[string]string{"Origin": "", "Sec-Fetch-Site": ""}},
		{"Origin null", victim, http.MethodPost, form, map[string]string{"Origin": "null", "Sec-Fetch-Site": ""}},
		{"foreign Origin", victim, http.MethodPost, form, map[string]string{"Origin": "http://evil.test", "Sec-Fetch-Site": ""}},
		{"Origin of another port", victim, http.MethodPost, form, map[string]string{"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": ""}},
		{"Origin with userinfo", victim, http.MethodPost, form, map[string]string{"Origin": "http://evil.test@" + strings.TrimPrefix(f.srv.URL, "http://"), "Sec-Fetch-Site": "cross-site"}},
		{"cross-site", victim, http.MethodPost, form, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		{"same-site", victim, http.MethodPost, form, map[string]string{"Sec-Fetch-Site": "same-site"}},
		{"none", victim, http.MethodPost, form, map[string]string{"Sec-Fetch-Site": "none"}},
		{"another browser's token", victim, http.MethodPost, otherForm, nil},
		{"no token", victim, http.MethodPost, without(form, "csrf"), nil},
		{"token in the query", victim, http.MethodPost, without(form, "csrf"), nil},
		{"GET", victim, http.MethodGet, nil, nil},
		{"PUT", victim, http.MethodPut, form, nil},
		{"method override", victim, http.MethodGet, nil, map[string]string{"X-HTTP-Method-Override": "POST"}},
	} {
		path := "/act"
		if tc.method == http.MethodGet || tc.name == "token in the query" {
			path += "?" + form.Encode()
		}
		resp, _ := tc.c.do(tc.method, path, tc.form, tc.hdr)
		if resp.StatusCode < 400 {
			t.Errorf("%s: %s, want a refusal", tc.name, resp.Status)
		}
		if st := f.state(t, id); st != parked.StateParked {
			t.Fatalf("%s: the message is %s", tc.name, st)
		}
	}
	// The real thing works: the refusals above were not for another reason.
	if resp, _ := victim.do(http.MethodPost, "/act", form, nil); resp.StatusCode != http.StatusOK || f.state(t, id) != parked.StateArchived {
		t.Errorf("the victim's own action: %s", resp.Status)
	}
}

func without(v url.Values, key string) url.Values {
	out := url.Values{}
	for k, vs := range v {
		if k != key {
			out[k] = vs
		}
	}
	return out
}

// Read-only: every POST, the confirmation page and the action, refused,
// whoever asks and however.
func TestReview26ReadOnlyRefusesEveryAction(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.ReadOnly = true; c.Token = token })
	id := f.park(t, parkSpec{Handler: "h", Topic: "t", Reason: "r"})
	sid := strconv.FormatInt(id, 10)
	c := f.client(t)
	c.header.Set("Authorization", "Bearer "+token)
	for _, p := range []string{"/", "/messages", "/messages/" + sid} {
		body := c.getOK(p)
		if strings.Contains(body, "/confirm") || strings.Contains(body, `/act"`) || strings.Contains(body, `name="csrf"`) && !strings.Contains(body, "/logout") {
			t.Errorf("GET %s shows an action", p)
		}
	}
	if resp, _ := c.get("/confirm?action=archive&id=" + sid); resp.StatusCode != http.StatusNotFound && resp.StatusCode != http.StatusForbidden {
		t.Errorf("the confirmation page: %s", resp.Status)
	}
	for _, path := range []string{"/act", "/act/", "//act", "/ACT", "/static/../act", "/login/../act", "/logout"} {
		form := url.Values{"action": {"archive"}, "id": {sid}, "csrf": {"x"}}
		if resp, _ := c.do(http.MethodPost, path, form, nil); resp.StatusCode < 300 {
			t.Errorf("POST %s: %s", path, resp.Status)
		}
		if st := f.state(t, id); st != parked.StateParked {
			t.Fatalf("POST %s: the message is %s", path, st)
		}
	}
}

// A session cookie with its expiry pushed back, or its MAC of another
// nonce, is refused; a bearer's CSRF token does not open a browser session.
func TestReview26ForgedSessions(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.Token = token })
	c := f.client(t)
	resp, _ := c.do(http.MethodPost, "/login", url.Values{"token": {token}}, nil)
	var sess string
	for _, ck := range resp.Cookies() {
		sess = ck.Value
	}
	parts := strings.Split(sess, ".")
	if len(parts) != 3 {
		t.Fatalf("session %q: want nonce.expiry.mac", sess)
	}
	exp, _ := strconv.ParseInt(parts[1], 10, 64)
	for name, v := range map[string]string{
		"later expiry":  parts[0] + "." + strconv.FormatInt(exp+1e6, 10) + "." + parts[2],
		"other nonce":   "AAAAAAAAAAAAAAAAAAAAAAAA." + parts[1] + "." + parts[2],
		"no MAC":        parts[0] + "." + parts[1] + ".",
		"bearer":        "bearer",
		"leading zeros": parts[0] + ".0" + parts[1] + "." + parts[2],
	} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, f.srv.URL+"/", nil)
		req.AddCookie(&http.Cookie{Name: "settle_console_session", Value: v})
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("a forged session (%s): %s", name, resp.Status)
		}
	}
}

// Every answer carries the headers, errors and unknown paths included.
func TestReview26HeadersOnEveryAnswer(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.Token = token; c.BasePath = "/console" })
	c := f.client(t)
	for _, tc := range []struct{ method, path string }{
		{"GET", "/console/"}, {"GET", "/console/nope"}, {"GET", "/console/static/nope.js"}, {"GET", "/console/static/"},
		{"GET", "/console/static/..%2fconsole.go"}, {"GET", "/console/static/%2e%2e/templates/login.html"},
		{"GET", "/elsewhere"}, {"GET", "/console"}, {"DELETE", "/console/login"}, {"POST", "/console/act"},
		{"GET", "/console/login"}, {"GET", "/console/messages/abc"}, {"GET", "/console/messages?outcome=x"},
	} {
		resp, body := c.do(tc.method, tc.path, nil, nil)
		h := resp.Header
		if !strings.Contains(h.Get("Content-Security-Policy"), "frame-ancestors 'none'") || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s %s (%s): CSP %q, nosniff %q", tc.method, tc.path, resp.Status, h.Get("Content-Security-Policy"), h.Get("X-Content-Type-Options"))
		}
		if resp.StatusCode != http.StatusOK && h.Get("Cache-Control") != "no-store" {
			t.Errorf("%s %s (%s): Cache-Control %q", tc.method, tc.path, resp.Status, h.Get("Cache-Control"))
		}
		if strings.Contains(body, "package console") || strings.Contains(body, token) {
			t.Errorf("%s %s: serves source or the token", tc.method, tc.path)
		}
		if loc := resp.Header.Get("Location"); loc != "" && !strings.HasPrefix(loc, "/console") {
			t.Logf("%s %s: redirected to %q, out of the base path", tc.method, tc.path, loc)
		}
	}
}

// A page of any site can make the operator's browser POST to the console
// (a form, no-cors): the refusal is logged with the request's path, which
// the attacker chose and may hold %0a. A log line must stay one line.
func TestReview26RefusalLogsOneLine(t *testing.T) {
	t.Parallel()
	var log syncBuffer
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) {
		c.Logger = watermill.NewStdLoggerWithOut(&log, false, false)
	})
	c := f.client(t)
	forged := "/act" + url.PathEscape("\n[watermill] 2026/12/02 07:00:00.000000 console.go:1: \tlevel=INFO  msg=\"console: replay\" ids=1000 ")
	resp, _ := c.do(http.MethodPost, forged, url.Values{"x": {"y"}}, map[string]string{"Origin": "http://evil.test", "Sec-Fetch-Site": "cross-site"})
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("the cross-site POST: %s", resp.Status)
	}
	out := log.String()
	if !strings.Contains(out, "refused") {
		t.Fatalf("the refusal is not logged:\n%s", out)
	}
	if n := strings.Count(strings.TrimSpace(out), "\n") + 1; n != 1 {
		t.Errorf("one refusal logged %d lines:\n%s", n, out)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Whoever knows the token can mint a session (the key derives from it);
// one whose expiry has passed, with a good MAC, is refused.
func TestReview26ExpiredSessionRefused(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.Token = token })
	k := hmac.New(sha256.New, []byte("settle console session key"))
	k.Write([]byte(token))
	key := k.Sum(nil)
	mint := func(exp int64) string {
		n := "AAAAAAAAAAAAAAAAAAAAAAAA"
		e := strconv.FormatInt(exp, 10)
		m := hmac.New(sha256.New, key)
		for _, p := range []string{"session", n, e} {
			m.Write([]byte(p))
			m.Write([]byte{0})
		}
		return n + "." + e + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
	}
	for _, tc := range []struct {
		exp  int64
		want int
	}{{time.Now().Add(time.Hour).Unix(), http.StatusOK}, {time.Now().Add(-time.Second).Unix(), http.StatusUnauthorized}} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, f.srv.URL+"/", nil)
		req.AddCookie(&http.Cookie{Name: "settle_console_session", Value: mint(tc.exp)})
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("a session expiring at %d: %s, want %d", tc.exp, resp.Status, tc.want)
		}
	}
}

// Oversized and forged inputs are refused cheaply: 1001 ids, 10,000 ids in
// a body past its bound, a forged cursor, a huge query.
func TestReview26OversizedInputs(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	id := f.park(t, parkSpec{Handler: "h", Topic: "t", Reason: "r"})
	c := f.client(t)
	form := confirmForm(t, c.getOK("/confirm?action=archive&id="+strconv.FormatInt(id, 10)))
	ids := make([]string, 1001)
	for i := range ids {
		ids[i] = strconv.Itoa(i + 1)
	}
	if resp, _ := c.get("/confirm?action=archive&id=" + strings.Join(ids, "&id=")); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("1001 ids: %s", resp.Status)
	}
	big := url.Values{"csrf": form["csrf"], "action": {"archive"}}
	for i := range 10000 {
		big.Add("id", strconv.Itoa(i+1))
	}
	if resp, _ := c.do(http.MethodPost, "/act", big, nil); resp.StatusCode < 400 {
		t.Errorf("10,000 ids: %s", resp.Status)
	}
	if st := f.state(t, id); st != parked.StateParked {
		t.Fatalf("the message is %s", st)
	}
	for _, cur := range []string{"x", "9999999999999999999.1", "-1.-1", strings.Repeat("9", 5000)} {
		resp, body := c.get("/messages?cursor=" + url.QueryEscape(cur))
		if resp.StatusCode == http.StatusOK || strings.Contains(body, "SELECT") {
			t.Errorf("cursor %.20q: %s", cur, resp.Status)
		}
		if resp.StatusCode >= 500 {
			t.Logf("cursor %.20q: %s (a bad request answered as the store's failure)", cur, resp.Status)
		}
	}
}
