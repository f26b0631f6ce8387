// The console in a real browser: headless Chromium, driven by chromedp,
// over the parked rows of a real run on PostgreSQL.
package e2e_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"

	"github.com/settle-go/settle"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

type sqlTx = sql.Tx

const orders = 5

// serve serves the console of s, configured by mod, on 127.0.0.1.
func serve[TTx any](t *testing.T, s *shop[TTx], mod func(*console.Config[TTx])) string {
	t.Helper()
	cfg := console.Config[TTx]{Parked: s.parked, Outbox: s.outbox, Claims: s.claims, TraceURL: "http://127.0.0.1:16686"}
	if mod != nil {
		mod(&cfg)
	}
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h) // 127.0.0.1, a port of its own
	t.Cleanup(srv.Close)
	return srv.URL
}

// groupOf returns the id of the group of the handler's rows of outcome.
func groupOf[TTx any](t *testing.T, s *shop[TTx], outcome string) string {
	t.Helper()
	gs, err := s.parked.Groups(t.Context(), parked.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range gs {
		if string(g.Outcome) == outcome {
			return g.ID
		}
	}
	t.Fatalf("no %s group in %+v", outcome, gs)
	return ""
}

// TestConsole runs the whole walk on PostgreSQL with RabbitMQ (where the
// screenshots are taken) and on SQLite with GoChannel, in one browser.
func TestConsole(t *testing.T) {
	ctx := browser(t)
	for _, db := range []struct {
		name   string
		open   func(testing.TB) testenv.DB
		broker string
		shots  bool
	}{
		{"postgres", testenv.Postgres, onRabbitMQ, true},
		{"sqlite", testenv.SQLite, onGoChannel, false},
	} {
		t.Run(db.name, func(t *testing.T) {
			shoot := func(t *testing.T, ctx context.Context, name string) {
				if db.shots {
					screenshot(t, ctx, name)
				}
			}
			walk(t, ctx, db.open(t).Driver(), db.broker, shoot)
		})
	}
}

// walk is the operator's walk through the console, over a real run on db.
func walk(t *testing.T, ctx context.Context, db sqldb.Driver[*sqlTx], broker string, shoot func(*testing.T, context.Context, string)) {
	s := newShop(t, db, broker)
	s.publish(t, orders)
	base := serve(t, s, nil)
	charge, poisoned := groupOf(t, s, "dead_lettered"), groupOf(t, s, "poisoned")

	t.Run("groups", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("#groups")))
		rows := eval[[]string](t, ctx, `[...document.querySelectorAll("#groups tbody tr")].map(r => r.innerText)`)
		if len(rows) != 2 {
			t.Fatalf("%d groups shown, want 2: %q", len(rows), rows)
		}
		if !strings.Contains(rows[0]+rows[1], "card declined for order") {
			t.Errorf("the groups do not show the reason: %q", rows)
		}
		n := eval[string](t, ctx, fmt.Sprintf(`document.querySelector('a[href*="group=%s"][href*="action=replay"]').innerText`, charge))
		if n != fmt.Sprintf("Replay %d…", orders) {
			t.Errorf("the charge group's replay button says %q", n)
		}
		shoot(t, ctx, "groups")
	})

	t.Run("filter", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(base+"/messages"), chromedp.WaitVisible(chromedp.CSS("#messages")))
		if n := eval[int](t, ctx, `document.querySelectorAll("#messages tbody tr").length`); n != orders+1 {
			t.Errorf("%d rows listed, want %d", n, orders+1)
		}
		shoot(t, ctx, "list")
		do(t, ctx,
			chromedp.SetValue(chromedp.CSS(`#filters select[name=outcome]`), "poisoned"),
			chromedp.Click(chromedp.CSS(`#filters button[type=submit]`)))
		waitJS(t, ctx, `location.search.includes("outcome=poisoned") && document.readyState === "complete"`)
		if u := run(t, ctx, chromedp.Location()); !strings.Contains(u, "outcome=poisoned") {
			t.Errorf("the filter did not go into the URL: %s", u)
		}
		if n := eval[int](t, ctx, `document.querySelectorAll("#messages tbody tr").length`); n != 1 {
			t.Errorf("%d rows of outcome poisoned, want 1", n)
		}
	})

	t.Run("hostile message shown as text", func(t *testing.T) {
		// From the filtered list, open the poisoned message.
		do(t, ctx, chromedp.Click(chromedp.CSS(`#messages tbody a`)), chromedp.WaitVisible(chromedp.CSS("#payload")))
		payload := run(t, ctx, chromedp.TextContent(chromedp.CSS("#payload")))
		reason := run(t, ctx, chromedp.TextContent(chromedp.CSS("#reason")))
		if payload != hostile || !strings.Contains(reason, hostile) {
			t.Errorf("payload %q, reason %q: want the hostile text as it is", payload, reason)
		}
		if v := eval[string](t, ctx, `typeof window.pwned`); v != "undefined" {
			t.Errorf("window.pwned is %s: the payload ran", v)
		}
		if n := eval[int](t, ctx, `document.querySelectorAll("main img, main script").length`); n != 0 {
			t.Errorf("%d img or script elements in the page: the payload became HTML", n)
		}
		// And in the list and the groups, where the reason shows too.
		for _, p := range []string{"/messages", "/"} {
			do(t, ctx, chromedp.Navigate(base+p), chromedp.WaitReady(chromedp.CSS("main")))
			if v := eval[string](t, ctx, `typeof window.pwned + document.querySelectorAll("main img, main script").length`); v != "undefined0" {
				t.Errorf("%s: %s", p, v)
			}
		}
	})

	t.Run("message", func(t *testing.T) {
		page, err := s.parked.List(t.Context(), parked.Query{Filter: parked.Filter{Group: charge}, Limit: 1})
		if err != nil || len(page.Messages) == 0 {
			t.Fatal(err)
		}
		m := page.Messages[0]
		do(t, ctx, chromedp.Navigate(fmt.Sprintf("%s/messages/%d", base, m.ID)), chromedp.WaitVisible(chromedp.CSS("#payload")))
		payload := run(t, ctx, chromedp.TextContent(chromedp.CSS("#payload")))
		if !strings.Contains(payload, "\n  \"order\": ") {
			t.Errorf("the JSON payload is not pretty-printed: %q", payload)
		}
		shoot(t, ctx, "message")
	})

	t.Run("replay a group once", func(t *testing.T) {
		confirm := fmt.Sprintf("%s/confirm?action=replay&group=%s", base, url.QueryEscape(charge))
		// Two tabs on the confirmation page: the second click is a stale
		// form, as a double click or a colleague's would be.
		other := tab(t, ctx)
		do(t, other, chromedp.Navigate(confirm), chromedp.WaitVisible(chromedp.CSS("#confirm")))
		do(t, ctx, chromedp.Navigate(base+"/"),
			chromedp.Click(chromedp.CSS(fmt.Sprintf(`a[href*="group=%s"][href*="action=replay"]`, charge))),
			chromedp.WaitVisible(chromedp.CSS("#confirm")))
		if n := run(t, ctx, chromedp.Text(chromedp.CSS("#count"))); n != fmt.Sprint(orders) {
			t.Errorf("the confirmation says %s messages, want %d", n, orders)
		}
		if d := run(t, ctx, chromedp.Text(chromedp.CSS("#destinations"))); !strings.Contains(d, s.topic) {
			t.Errorf("the confirmation does not name the destination: %q", d)
		}
		shoot(t, ctx, "confirm")
		s.fixed.Store(true) // the bug is fixed; now replay
		do(t, ctx, chromedp.Click(chromedp.CSS(`#confirm button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#result")))
		if r := run(t, ctx, chromedp.Text(chromedp.CSS("#result"))); !strings.HasPrefix(r, fmt.Sprintf("%d message(s) written", orders)) {
			t.Errorf("the result says %q", r)
		}
		do(t, other, chromedp.Click(chromedp.CSS(`#confirm button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#result")))
		if r := run(t, other, chromedp.Text(chromedp.CSS("#result"))); !strings.HasPrefix(r, "0 message(s) written") {
			t.Errorf("the second click says %q", r)
		}
		waitFor(t, "every order charged", func() bool {
			_, charged := s.counts()
			return len(charged) == orders
		})
		time.Sleep(500 * time.Millisecond) // time for a duplicate to show
		delivered, charged := s.counts()
		for i := 1; i <= orders; i++ {
			if delivered[i] != 1 || charged[i] != 1 {
				t.Errorf("order %d: delivered %d times, charged %d times; want once", i, delivered[i], charged[i])
			}
		}
		if c, _ := s.parked.Count(t.Context(), parked.Filter{Group: charge, State: parked.StateReplayed}); c != orders {
			t.Errorf("%d rows of the group replayed, want %d", c, orders)
		}
	})

	t.Run("outbox, activity, claims", func(t *testing.T) {
		do(t, ctx, chromedp.Navigate(base+"/outbox"), chromedp.WaitVisible(chromedp.CSS("#relays")))
		if n := run(t, ctx, chromedp.Text(chromedp.CSS("#relays"))); n != "1" {
			t.Errorf("the outbox page says %s relays alive, want 1", n)
		}
		if n := run(t, ctx, chromedp.Text(chromedp.CSS("#pending"))); n != "0" {
			t.Errorf("the outbox page says %s pending after the replay, want 0", n)
		}
		shoot(t, ctx, "outbox")
		do(t, ctx, chromedp.Navigate(base+"/activity"), chromedp.WaitVisible(chromedp.CSS("svg.chart")))
		if n := eval[int](t, ctx, `document.querySelectorAll("svg.chart rect.dead[height]:not([height='0'])").length`); n == 0 {
			t.Error("the activity chart has no bar of dead-lettered messages")
		}
		shoot(t, ctx, "activity")
		do(t, ctx, chromedp.Navigate(base+"/claims"), chromedp.WaitVisible(chromedp.CSS("#lookup")),
			chromedp.SetValue(chromedp.CSS("#lookup input[name=scope]"), "charge"),
			chromedp.SetValue(chromedp.CSS("#lookup input[name=key]"), replayedUUID(t, s, charge)),
			chromedp.Click(chromedp.CSS("#lookup button")), chromedp.WaitVisible(chromedp.CSS("#found")))
		if st := run(t, ctx, chromedp.Text(chromedp.CSS("#found .state"))); st != "confirmed" {
			t.Errorf("the replayed message's key is %q, want confirmed", st)
		}
		shoot(t, ctx, "claims")
	})

	t.Run("archive one", func(t *testing.T) {
		page, _ := s.parked.List(t.Context(), parked.Query{Filter: parked.Filter{Group: poisoned}, Limit: 1})
		id := page.Messages[0].ID
		do(t, ctx, chromedp.Navigate(fmt.Sprintf("%s/messages/%d", base, id)),
			chromedp.Click(chromedp.CSS("#archive")), chromedp.WaitVisible(chromedp.CSS("#confirm")))
		if n := run(t, ctx, chromedp.Text(chromedp.CSS("#count"))); n != "1" {
			t.Errorf("the confirmation says %s, want 1", n)
		}
		do(t, ctx, chromedp.Click(chromedp.CSS(`#confirm button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#result")))
		m, err := s.parked.Get(t.Context(), id)
		if err != nil || m.State != parked.StateArchived {
			t.Errorf("the row is %s (%v), want archived", m.State, err)
		}
		do(t, ctx, chromedp.Navigate(fmt.Sprintf("%s/messages/%d", base, id)), chromedp.WaitVisible(chromedp.CSS("#payload")))
		if n := eval[int](t, ctx, `document.querySelectorAll("#replay, #archive").length`); n != 0 {
			t.Errorf("an archived message still offers %d actions", n)
		}
	})

	t.Run("cross-site POST refused", func(t *testing.T) {
		// A parked row to aim at, and a page of another origin that posts
		// a form to the console as soon as it loads.
		id := reparkOne(t, s)
		evil := httptest.NewServer(evilPage(base, id))
		t.Cleanup(evil.Close)
		do(t, ctx, chromedp.Navigate(base+"/")) // the console's cookies are set
		do(t, ctx, chromedp.Navigate(evil.URL), chromedp.WaitReady(chromedp.CSS("#error")))
		if u := run(t, ctx, chromedp.Location()); !strings.HasPrefix(u, base) {
			t.Fatalf("the evil form did not post to the console: at %s", u)
		}
		if m, _ := s.parked.Get(t.Context(), id); m.State != parked.StateParked {
			t.Errorf("a cross-site form archived the row (%s)", m.State)
		}
		// From the console's own page (same origin), with a forged CSRF
		// token, and with none.
		for _, csrf := range []string{"forged", ""} {
			do(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitReady(chromedp.CSS("main")))
			msg := post(t, ctx, "/act", map[string]string{"action": "archive", "id": fmt.Sprint(id), "csrf": csrf})
			if !strings.Contains(msg, "CSRF") {
				t.Errorf("a POST with CSRF token %q: %q, want it refused for its CSRF token", csrf, msg)
			}
		}
		if m, _ := s.parked.Get(t.Context(), id); m.State != parked.StateParked {
			t.Errorf("a forged POST archived the row (%s)", m.State)
		}
	})

	t.Run("read-only", func(t *testing.T) {
		id := reparkOne(t, s)
		ro := serve(t, s, func(c *console.Config[*sqlTx]) { c.ReadOnly = true })
		for _, p := range []string{"/", "/messages", fmt.Sprintf("/messages/%d", id)} {
			do(t, ctx, chromedp.Navigate(ro+p), chromedp.WaitReady(chromedp.CSS("main")))
			if n := eval[int](t, ctx, `document.querySelectorAll('a[href*="/confirm"], form[action$="/act"], main input[type=checkbox], #replay, #archive').length`); n != 0 {
				t.Errorf("read-only %s shows %d actions", p, n)
			}
			if b := run(t, ctx, chromedp.Text(chromedp.CSS(".badge.ro"))); b != "read-only" {
				t.Errorf("read-only %s does not say so: %q", p, b)
			}
		}
		if msg := post(t, ctx, "/act", map[string]string{"action": "replay", "id": fmt.Sprint(id)}); !strings.Contains(msg, "read-only") {
			t.Errorf("a read-only POST: %q, want it refused as read-only", msg)
		}
		if m, _ := s.parked.Get(t.Context(), id); m.State != parked.StateParked {
			t.Errorf("a read-only console changed the row (%s)", m.State)
		}
	})

	t.Run("token", func(t *testing.T) {
		// A token of its own: cookies are per host, not per port, and a
		// session of another console with the same token would be valid.
		token := uniq("e2e-token")
		sec := serve(t, s, func(c *console.Config[*sqlTx]) { c.Token = token })
		do(t, ctx, chromedp.Navigate(sec+"/messages"), chromedp.WaitVisible(chromedp.CSS("input[name=token]")))
		if u := run(t, ctx, chromedp.Location()); u != sec+"/login" {
			t.Errorf("without a session the browser is at %s, want the login page", u)
		}
		for _, p := range []string{"/", "/outbox", "/claims", fmt.Sprintf("/messages?group=%s", charge)} {
			do(t, ctx, chromedp.Navigate(sec+p), chromedp.WaitVisible(chromedp.CSS("input[name=token]")))
			if n := eval[int](t, ctx, `document.querySelectorAll("table, #groups, #messages").length`); n != 0 {
				t.Errorf("%s without the token shows data", p)
			}
		}
		do(t, ctx, chromedp.SendKeys(chromedp.CSS("input[name=token]"), "wrong-token-0123456789"),
			chromedp.Submit(chromedp.CSS("input[name=token]")), chromedp.WaitVisible(chromedp.CSS(".error")))
		do(t, ctx, chromedp.SetValue(chromedp.CSS("input[name=token]"), token),
			chromedp.Submit(chromedp.CSS("input[name=token]")), chromedp.WaitVisible(chromedp.CSS("#groups")))
		if c := eval[string](t, ctx, `document.cookie`); c != "" {
			t.Errorf("a script can read the session cookie: %q", c)
		}
		if n := eval[int](t, ctx, fmt.Sprintf(`document.documentElement.outerHTML.indexOf(%q)`, token)); n != -1 {
			t.Error("the page shows the token")
		}
	})
}

// waitJS waits until expr is true in the tab, through navigations (an
// evaluation that a navigation interrupts is tried again).
func waitJS(t *testing.T, ctx context.Context, expr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		ok, err := chromedp.Run(c, chromedp.Evaluate[bool](expr))
		cancel()
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after 20s (%v)", expr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// post submits a form of fields to path from the page the tab is on (the
// pages' CSP forbids fetch), and returns the error the console answered
// with, "" when none.
func post(t *testing.T, ctx context.Context, path string, fields map[string]string) string {
	t.Helper()
	js, _ := json.Marshal(fields)
	do(t, ctx, chromedp.Evaluate[chromedp.Void](fmt.Sprintf(`(() => {
		const f = document.createElement("form");
		f.method = "post"; f.action = %q;
		for (const [k, v] of Object.entries(%s)) {
			const i = document.createElement("input"); i.name = k; i.value = v; f.appendChild(i);
		}
		document.body.appendChild(f); f.submit();
	})()`, path, js)), chromedp.WaitReady(chromedp.CSS("#error, #result")))
	return eval[string](t, ctx, `(document.getElementById("error") || {innerText: ""}).innerText`)
}

// reparkOne parks one more message of handler charge and returns its row.
func reparkOne[TTx any](t *testing.T, s *shop[TTx]) int64 {
	t.Helper()
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"order": 99, "cents": 1}`))
	err := s.parked.Park(t.Context(), settle.Parked{Message: m, Outcome: settle.DeadLettered, Cause: errors.New("card declined for order 99"),
		Handler: "charge", Topic: s.topic, Attempts: 2, LastFailure: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	page, err := s.parked.List(t.Context(), parked.Query{Filter: parked.Filter{UUID: m.UUID}, Limit: 1})
	if err != nil || len(page.Messages) != 1 {
		t.Fatalf("the row of %s: %v", m.UUID, err)
	}
	return page.Messages[0].ID
}

// replayedUUID returns the dedupe key of a replayed copy of a row of group:
// its UUID (the pipeline dedupes by UUID), as the handler was given it.
func replayedUUID[TTx any](t *testing.T, s *shop[TTx], group string) string {
	t.Helper()
	page, err := s.parked.List(t.Context(), parked.Query{Filter: parked.Filter{Group: group, State: parked.StateReplayed}, Limit: 1})
	if err != nil || len(page.Messages) == 0 {
		t.Fatalf("no replayed row: %v", err)
	}
	m, err := s.parked.Get(t.Context(), page.Messages[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	var o order
	if err := json.Unmarshal(m.Payload, &o); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chargedUUID[o.Order]
}

// evilPage is a page of another origin that posts a form to the console's
// archive action as soon as it loads.
func evilPage(console string, id int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, `<!doctype html><form id=f method=post action="%s/act">
<input name=action value=archive><input name=id value=%d><input name=csrf value=guess></form>
<script>document.getElementById("f").submit()</script>`, console, id)
	})
}
