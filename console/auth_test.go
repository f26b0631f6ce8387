package console_test

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/parked"
)

const token = "s3cret-t0ken-0123456789"

// With a token, a request without it is refused; with it (header or
// login) served; and the token shows nowhere.
func TestTokenRequired(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.Token = token })
	id := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	c := f.client(t)

	for _, path := range []string{"/", "/messages", "/messages/" + strconv.FormatInt(id, 10), "/outbox", "/claims", "/activity", "/confirm?action=archive&id=1"} {
		resp, body := c.get(path)
		if resp.StatusCode != http.StatusUnauthorized || strings.Contains(body, "charge") {
			t.Errorf("GET %s without a token: %s, want 401 and no data", path, resp.Status)
		}
		resp, _ = c.do(http.MethodGet, path, nil, map[string]string{"Authorization": "Bearer " + token + "x"})
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s with a wrong token: %s, want 401", path, resp.Status)
		}
		resp, _ = c.do(http.MethodGet, path, nil, map[string]string{"Authorization": "Basic " + token})
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s with the token in the wrong scheme: %s, want 401", path, resp.Status)
		}
	}
	// A browser is sent to the login form.
	resp, _ := c.do(http.MethodGet, "/messages", nil, map[string]string{"Accept": "text/html"})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/login" {
		t.Errorf("a browser without a session: %s to %q, want 303 to /login", resp.Status, resp.Header.Get("Location"))
	}
	// The static files need no token (the login page uses them).
	if resp, _ := c.get("/static/console.css"); resp.StatusCode != http.StatusOK {
		t.Errorf("the style sheet: %s", resp.Status)
	}
	// The header.
	if resp, body := c.do(http.MethodGet, "/", nil, map[string]string{"Authorization": "Bearer " + token}); resp.StatusCode != http.StatusOK || !strings.Contains(body, "charge") {
		t.Errorf("GET / with the token: %s", resp.Status)
	}
	// A wrong login.
	resp, body := c.do(http.MethodPost, "/login", url.Values{"token": {token[:len(token)-1]}}, nil)
	if resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 || !strings.Contains(body, "not the token") {
		t.Errorf("a wrong login: %s with %d cookies, want 401 and none", resp.Status, len(resp.Cookies()))
	}
	// A login from another site.
	resp, _ = c.do(http.MethodPost, "/login", url.Values{"token": {token}}, map[string]string{"Origin": "http://evil.test", "Sec-Fetch-Site": ""})
	if resp.StatusCode != http.StatusForbidden || len(resp.Cookies()) != 0 {
		t.Errorf("a cross-site login: %s, want 403 and no cookie", resp.Status)
	}
	// The login.
	resp, _ = c.do(http.MethodPost, "/login", url.Values{"token": {token}}, nil)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("login: %s", resp.Status)
	}
	var sess *http.Cookie
	for _, ck := range resp.Cookies() {
		sess = ck
	}
	if sess == nil || !sess.HttpOnly || sess.SameSite != http.SameSiteStrictMode || strings.Contains(sess.Value, token) {
		t.Fatalf("the session cookie %+v: want HttpOnly, SameSite=Strict, without the token", sess)
	}
	body = c.getOK("/")
	if !strings.Contains(body, "charge") || !strings.Contains(body, "Log out") {
		t.Error("the session does not show the groups and a log-out button")
	}
	// The session acts, with its CSRF token.
	form := confirmForm(t, c.getOK("/confirm?action=archive&id="+strconv.FormatInt(id, 10)))
	if resp, _ := c.do(http.MethodPost, "/act", form, nil); resp.StatusCode != http.StatusOK || f.state(t, id) != parked.StateArchived {
		t.Errorf("an action of the session: %s", resp.Status)
	}
	for _, page := range []string{body, c.getOK("/outbox"), c.getOK("/messages")} {
		if strings.Contains(page, token) {
			t.Error("a page shows the token")
		}
	}
	// A forged cookie: the session's nonce with another MAC.
	forged := f.client(t)
	u, _ := url.Parse(f.srv.URL)
	parts := strings.Split(sess.Value, ".")
	parts[1] = "9999999999" // a later expiry, the MAC unchanged
	forged.http.Jar.SetCookies(u, []*http.Cookie{{Name: sess.Name, Value: strings.Join(parts, "."), Path: "/"}})
	if resp, _ := forged.get("/"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a forged session: %s, want 401", resp.Status)
	}
	// Log out: the cookie is cleared.
	csrf := csrfOf(t, body)
	if resp, _ := c.do(http.MethodPost, "/logout", url.Values{"csrf": {csrf}}, nil); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("log out: %s", resp.Status)
	}
	if resp, _ := c.get("/"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("after log out: %s, want 401", resp.Status)
	}
}

// Mounted under a path, the console strips it and writes its links
// under it.
func TestBasePath(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.BasePath = "/ops/console" })
	id := f.park(t, parkSpec{Handler: "charge", Topic: "orders", Reason: "declined"})
	c := f.client(t)
	body := c.getOK("/ops/console/")
	if !strings.Contains(body, `href="/ops/console/messages?group=`) || !strings.Contains(body, `/ops/console/static/console.css`) {
		t.Error("the links are not under the base path")
	}
	c.getOK("/ops/console/messages/" + strconv.FormatInt(id, 10))
	if resp, _ := c.get("/messages"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("a path outside the base: %s, want 404", resp.Status)
	}
	if resp, _ := c.get("/ops/console"); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("the base without its slash: %s, want a redirect", resp.Status)
	}
}
