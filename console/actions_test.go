package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// state returns the state of row id.
func (f *fixture[TTx]) state(t *testing.T, id int64) parked.State {
	t.Helper()
	m, err := f.parked.Get(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return m.State
}

// pending returns the outbox's pending rows.
func (f *fixture[TTx]) pending(t *testing.T) int64 {
	t.Helper()
	st, err := f.outbox.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return st.Pending
}

// A group replayed through the confirmation page: the page says how many
// and where, the action writes one outbox row per message, and a second
// click (or a resent form) writes none.
func TestReplayGroup(t *testing.T) {
	t.Parallel()
	for _, db := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"sqlite", func(t *testing.T) { replayGroup(t, sqlite(t)) }},
		{"postgres", func(t *testing.T) { replayGroup(t, testenv.Postgres(t).Driver()) }},
		{"pgx", func(t *testing.T) { replayGroup(t, testenv.Pgx(t)) }},
		{"mysql", func(t *testing.T) { replayGroup(t, testenv.MySQL(t).Driver()) }},
	} {
		t.Run(db.name, func(t *testing.T) { t.Parallel(); db.run(t) })
	}
}

func replayGroup[TTx any](t *testing.T, db sqldb.Driver[TTx]) {
	f := setup(t, db, nil)
	var ids []int64
	for i := range 3 {
		ids = append(ids, f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "order " + strconv.Itoa(i) + " declined"}))
	}
	other := f.park(t, parkSpec{Handler: "ship", Topic: "orders", Reason: "no address"})
	m, err := f.parked.Get(t.Context(), ids[0])
	if err != nil {
		t.Fatal(err)
	}
	c := f.client(t)
	page := c.getOK("/confirm?action=replay&group=" + url.QueryEscape(m.Group))
	if !strings.Contains(page, `<strong id="count">3</strong>`) || !strings.Contains(page, `<td class="mono">orders</td><td class="num">3</td>`) {
		t.Fatalf("the confirmation does not say 3 messages to orders:\n%s", page)
	}
	if f.pending(t) != 0 || f.state(t, ids[0]) != parked.StateParked {
		t.Fatal("the confirmation page acted")
	}
	form := confirmForm(t, page)
	resp, body := c.do(http.MethodPost, "/act", form, nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, "<strong>3</strong> message(s) written") {
		t.Fatalf("POST /act: %s\n%s", resp.Status, body)
	}
	if n := f.pending(t); n != 3 {
		t.Errorf("%d outbox rows after the replay, want 3", n)
	}
	for _, id := range ids {
		if st := f.state(t, id); st != parked.StateReplayed {
			t.Errorf("row %d is %s, want replayed", id, st)
		}
	}
	if st := f.state(t, other); st != parked.StateParked {
		t.Errorf("a row of another group is %s", st)
	}
	// The same form again: nothing more is published.
	resp, body = c.do(http.MethodPost, "/act", form, nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, "<strong>0</strong> message(s) written") {
		t.Errorf("the second POST: %s\n%s", resp.Status, body)
	}
	if n := f.pending(t); n != 3 {
		t.Errorf("%d outbox rows after the second click, want 3", n)
	}
}

// A group's confirmation pins the rows it counted: a message parked in the
// group after the page was drawn is not replayed by its button.
func TestGroupPinned(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	first := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	m, _ := f.parked.Get(t.Context(), first)
	c := f.client(t)
	form := confirmForm(t, c.getOK("/confirm?action=archive&group="+url.QueryEscape(m.Group)))
	late := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	if resp, body := c.do(http.MethodPost, "/act", form, nil); !strings.Contains(body, "<strong>1</strong> message(s) archived") {
		t.Fatalf("POST /act: %s\n%s", resp.Status, body)
	}
	if f.state(t, first) != parked.StateArchived || f.state(t, late) != parked.StateParked {
		t.Errorf("first %s (want archived), late %s (want parked)", f.state(t, first), f.state(t, late))
	}
	// A group's action without the pin of its page is refused.
	form.Del("until")
	if resp, _ := c.do(http.MethodPost, "/act", form, nil); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a group's POST without until: %s, want 400", resp.Status)
	}
}

// Forged and cross-site POSTs are refused and change nothing.
func TestCrossSiteRefused(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), nil)
	id := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	c := f.client(t)
	page := c.getOK("/confirm?action=archive&id=" + strconv.FormatInt(id, 10))
	form := confirmForm(t, page)
	other := f.client(t) // another browser: a session of its own
	otherForm := confirmForm(t, other.getOK("/confirm?action=archive&id="+strconv.FormatInt(id, 10)))
	noCSRF := url.Values{}
	for k, v := range form {
		if k != "csrf" {
			noCSRF[k] = v
		}
	}
	badCSRF := url.Values{"csrf": {"x" + form.Get("csrf")}, "action": {"archive"}, "id": {strconv.FormatInt(id, 10)}}
	for _, tc := range []struct {
		name string
		form url.Values
		hdr  map[string]string
	}{
		{"no CSRF token", noCSRF, nil},
		{"a wrong CSRF token", badCSRF, nil},
		{"another browser's CSRF token", otherForm, nil},
		{"no Origin", form, map[string]string{"Origin": "", "Sec-Fetch-Site": ""}},
		{"a foreign Origin", form, map[string]string{"Origin": "http://evil.test", "Sec-Fetch-Site": ""}},
		{"Origin null", form, map[string]string{"Origin": "null", "Sec-Fetch-Site": ""}},
		{"cross-site fetch", form, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		{"same-site fetch", form, map[string]string{"Sec-Fetch-Site": "same-site"}},
	} {
		resp, body := c.do(http.MethodPost, "/act", tc.form, tc.hdr)
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %s, want 403\n%s", tc.name, resp.Status, body)
		}
		if st := f.state(t, id); st != parked.StateParked {
			t.Fatalf("%s: the row is %s", tc.name, st)
		}
	}
	if resp, _ := c.do(http.MethodPost, "/act", form, nil); resp.StatusCode != http.StatusOK || f.state(t, id) != parked.StateArchived {
		t.Errorf("the genuine form: %s, row %s", resp.Status, f.state(t, id))
	}
}

// Read-only: no button, no confirmation page, every POST refused, even
// one with a valid session and CSRF token.
func TestReadOnly(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.ReadOnly, c.Token = true, token })
	id := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	m, _ := f.parked.Get(t.Context(), id)
	c := f.client(t)
	if resp, _ := c.do(http.MethodPost, "/login", url.Values{"token": {token}}, nil); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("login: %s", resp.Status)
	}
	var csrf string
	for _, path := range []string{"/", "/messages", "/messages/" + strconv.FormatInt(id, 10)} {
		body := c.getOK(path)
		for _, bad := range []string{"/confirm", `"/act"`, "Replay…", "Replay selected", "Archive", `type="checkbox"`} {
			if strings.Contains(body, bad) {
				t.Errorf("read-only %s shows %q", path, bad)
			}
		}
		if !strings.Contains(body, `class="badge ro"`) {
			t.Errorf("read-only %s does not say so", path)
		}
		csrf = csrfOf(t, body) // the log-out form's
	}
	if resp, _ := c.get("/confirm?action=replay&group=" + url.QueryEscape(m.Group)); resp.StatusCode != http.StatusNotFound {
		t.Errorf("read-only confirmation page: %s, want 404", resp.Status)
	}
	for _, action := range []string{"replay", "archive"} {
		form := url.Values{"action": {action}, "id": {strconv.FormatInt(id, 10)}, "csrf": {csrf}}
		if resp, body := c.do(http.MethodPost, "/act", form, nil); resp.StatusCode != http.StatusForbidden || !strings.Contains(body, `id="error">the console is read-only`) {
			t.Errorf("read-only POST %s: %s, want 403 saying read-only", action, resp.Status)
		}
	}
	if f.state(t, id) != parked.StateParked || f.pending(t) != 0 {
		t.Error("a read-only console changed something")
	}
}
