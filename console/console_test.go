package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

func TestConfigRefused(t *testing.T) {
	t.Parallel()
	db := sqldb.Std(nil, sqldb.SQLite)
	ps, err := parked.New(db, parked.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ok := console.Config[*sqlTx]{Parked: ps, Outbox: ob}
	for _, tc := range []struct {
		name  string
		mod   func(*console.Config[*sqlTx])
		field string
	}{
		{"no parked store", func(c *console.Config[*sqlTx]) { c.Parked = nil }, "Parked"},
		{"no outbox", func(c *console.Config[*sqlTx]) { c.Outbox = nil }, "Outbox"},
		{"short token", func(c *console.Config[*sqlTx]) { c.Token = "short" }, "Token"},
		{"token with a line break", func(c *console.Config[*sqlTx]) { c.Token = "0123456789abcdef\r\nX: y" }, "Token"},
		{"javascript trace URL", func(c *console.Config[*sqlTx]) { c.TraceURL = "javascript:alert(1)" }, "TraceURL"},
		{"relative trace URL", func(c *console.Config[*sqlTx]) { c.TraceURL = "/jaeger" }, "TraceURL"},
		{"base path without /", func(c *console.Config[*sqlTx]) { c.BasePath = "console" }, "BasePath"},
		{"base path ending in /", func(c *console.Config[*sqlTx]) { c.BasePath = "/console/" }, "BasePath"},
		{"base path with a quote", func(c *console.Config[*sqlTx]) { c.BasePath = `/a"b` }, "BasePath"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.mod(&cfg)
			_, err := console.New(cfg)
			if err == nil || !strings.Contains(err.Error(), "Config."+tc.field) {
				t.Errorf("New: %v; want an error naming Config.%s", err, tc.field)
			}
		})
	}
	if _, err := console.New(ok); err != nil {
		t.Errorf("New of a good config: %v", err)
	}
}

func TestSecurityHeaders(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	c := f.client(t)
	for _, path := range []string{"/", "/messages", "/outbox", "/claims", "/activity", "/static/console.css", "/nope"} {
		resp, _ := c.get(path)
		h := resp.Header
		csp := h.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'none'", "script-src 'self'", "frame-ancestors 'none'", "form-action 'self'", "base-uri 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("%s: Content-Security-Policy %q lacks %q", path, csp, want)
			}
		}
		if strings.Contains(csp, "unsafe") {
			t.Errorf("%s: Content-Security-Policy %q allows something unsafe", path, csp)
		}
		for k, want := range map[string]string{"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"} {
			if got := h.Get(k); got != want {
				t.Errorf("%s: %s = %q, want %q", path, k, got, want)
			}
		}
	}
}

// Every page shows the rows of a real store.
func TestPages(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.TraceURL = "http://jaeger.test:16686/" })
	id := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "card 4242 declined", Payload: `{"order":17,"amount":[1,2]}`,
		Key: "order:17", TraceID: "0af7651916cd43dd8448eb211c80319c", Meta: map[string]string{"tenant": "acme"}})
	f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "card 5555 declined", Payload: "plain text"})
	bin := f.park(t, parkSpec{Handler: "ship", Topic: "orders", Reason: "undecodable", Outcome: settle.Poisoned, Payload: "\x00\xff\xfe"})
	c := f.client(t)

	groups := c.getOK("/")
	for _, want := range []string{"charge", "ship", "card", "declined", ">2<", "dead_lettered", "poisoned", "/confirm?action=replay&amp;group="} {
		if !strings.Contains(groups, want) {
			t.Errorf("the groups page lacks %q", want)
		}
	}
	list := c.getOK("/messages?handler=charge")
	if strings.Count(list, `name="id"`) != 2 || strings.Contains(list, "undecodable") {
		t.Errorf("the list filtered on handler charge shows %d rows (want 2), or ship's", strings.Count(list, `name="id"`))
	}
	msg := c.getOK("/messages/" + strconv.FormatInt(id, 10))
	for _, want := range []string{"card 4242 declined", "&#34;order&#34;: 17", "order:17", "tenant", "acme",
		`href="http://jaeger.test:16686/trace/0af7651916cd43dd8448eb211c80319c"`, "JSON"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the message page lacks %q", want)
		}
	}
	if !strings.Contains(c.getOK("/messages/"+strconv.FormatInt(bin, 10)), "00 ff fe") {
		t.Error("a binary payload is not shown as a hex dump")
	}
	for _, p := range []string{"/activity", "/activity?hours=72", "/activity?hours=168"} {
		if a := c.getOK(p); !strings.Contains(a, "2 dead-lettered") || !strings.Contains(a, "1 poisoned") {
			t.Errorf("%s does not count the rows", p)
		}
	}
	if a := c.getOK("/activity?hours=168"); strings.Count(a, `class="dead"`) != 28 || !strings.Contains(a, "per 6 hours") {
		t.Errorf("a week is not 28 bars of 6 hours")
	}
	if o := c.getOK("/outbox"); !strings.Contains(o, "nothing pending") {
		t.Error("the outbox page does not say nothing is pending")
	}
	if resp, _ := c.get("/messages/99999"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("an unknown message: %s, want 404", resp.Status)
	}
	if resp, _ := c.get("/messages?outcome=done"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a bad filter: %s, want 400", resp.Status)
	}
	// A cursor is the client's to forge: the store refuses it, and the
	// console says the request is bad, not that it failed.
	for _, cur := range []string{"not-base64!", "MS4xLjIuMw", "Mi4xLjI", "MS54LjI"} {
		if resp, body := c.get("/messages?cursor=" + cur); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "not a cursor of List") {
			t.Errorf("cursor %q: %s, want 400 naming the cursor", cur, resp.Status)
		}
	}
}

// The list pages through every row once, newest first, with the filter
// kept across pages.
func TestKeysetPages(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	base := time.Now().Add(-time.Hour)
	want := map[int64]bool{}
	for i := range 23 {
		id := f.park(t, parkSpec{Handler: "a", Topic: "t", Reason: "boom", At: base.Add(time.Duration(i) * time.Second)})
		want[id] = true
		f.park(t, parkSpec{Handler: "b", Topic: "t", Reason: "boom", At: base.Add(time.Duration(i) * time.Second)})
	}
	c := f.client(t)
	seen := map[int64]bool{}
	path := "/messages?handler=a&limit=5"
	for pages := 0; path != ""; pages++ {
		if pages > 10 {
			t.Fatal("more pages than rows")
		}
		body := c.getOK(path)
		for _, m := range idRE.FindAllStringSubmatch(body, -1) {
			id, _ := strconv.ParseInt(m[1], 10, 64)
			if seen[id] || !want[id] {
				t.Errorf("row %d shown twice, or not of handler a", id)
			}
			seen[id] = true
		}
		path = ""
		if m := nextRE.FindStringSubmatch(body); m != nil {
			path = strings.TrimPrefix(strings.ReplaceAll(m[1], "&amp;", "&"), f.srv.URL)
			if !strings.Contains(path, "handler=a") {
				t.Errorf("the next page's link %q drops the filter", path)
			}
		}
	}
	if len(seen) != len(want) {
		t.Errorf("paged through %d rows of handler a, want %d", len(seen), len(want))
	}
}

// Values from a message are text in the page, whatever they hold.
func TestHostileValuesEscaped(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.TraceURL = "http://jaeger.test" })
	hostile := `<script>window.pwned=1</script>"><img src=x onerror=alert(1)>`
	id := f.park(t, parkSpec{Handler: "h<b>", Topic: "t'\"", Reason: hostile, Payload: hostile, Key: hostile,
		TraceID: `"><script>x</script>`, Meta: map[string]string{"<i>k": hostile}})
	c := f.client(t)
	for _, path := range []string{"/", "/messages", "/messages/" + strconv.FormatInt(id, 10), "/messages?reason=" + url.QueryEscape(hostile),
		"/confirm?action=replay&id=" + strconv.FormatInt(id, 10), "/claims?scope=" + url.QueryEscape(hostile) + "&key=" + url.QueryEscape(hostile)} {
		body := c.getOK(path)
		for _, bad := range []string{"<script>window", "<img", "<b>", "<i>k", "onerror=alert(1)>"} {
			if strings.Contains(body, bad) {
				t.Errorf("%s: %q reaches the page unescaped", path, bad)
			}
		}
		if !strings.Contains(path, "confirm") && !strings.Contains(body, "&lt;script&gt;") {
			t.Errorf("%s: the hostile text is not shown escaped", path)
		}
	}
	if strings.Contains(c.getOK("/messages/"+strconv.FormatInt(id, 10)), "jaeger.test/trace") {
		t.Error("a trace id that is not 32 hex digits is made a link")
	}
}
