package console_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// fixture is a console over stores of their own in one database, served
// by an httptest server.
type fixture[TTx any] struct {
	db     sqldb.Driver[TTx]
	parked *parked.Store[TTx]
	outbox *outbox.Outbox[TTx]
	claims *dedupe.SQLStore[TTx]
	srv    *httptest.Server
	cfg    console.Config[TTx]
}

// setup creates the tables of the stores in db (dropped when the test
// ends) and serves their console, configured by mod.
func setup[TTx any](t *testing.T, db sqldb.Driver[TTx], mod func(*console.Config[TTx])) *fixture[TTx] {
	t.Helper()
	ctx := t.Context()
	table, topic, dd := uniq("pk"), uniq("ob"), uniq("dd")
	ps, err := parked.New(db, parked.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(db, outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	claims, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Table: dd})
	if err != nil {
		t.Fatal(err)
	}
	var ddl []string
	ddl = append(ddl, ps.Schema()...)
	ddl = append(ddl, ob.Schema()...)
	ddl = append(ddl, claims.Schema()...)
	for _, s := range ddl {
		if _, err := db.DB().Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	t.Cleanup(func() {
		if db.Dialect() == sqldb.SQLite {
			return // a file of the test's own
		}
		for _, name := range []string{table, table + "_groups", topic, topic + "_relays", dd} {
			q := `DROP TABLE IF EXISTS "` + name + `"`
			if db.Dialect() == sqldb.MySQL {
				q = "DROP TABLE IF EXISTS `" + name + "`"
			}
			_, _ = db.DB().Exec(context.Background(), q)
		}
	})
	cfg := console.Config[TTx]{Parked: ps, Outbox: ob, Claims: claims}
	if mod != nil {
		mod(&cfg)
	}
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &fixture[TTx]{db: db, parked: ps, outbox: ob, claims: claims, srv: srv, cfg: cfg}
}

// sqlite is the database most tests run on: embedded, a file per test.
func sqlite(t *testing.T) sqldb.Driver[*sqlTx] { return testenv.SQLite(t).Driver() }

type sqlTx = sql.Tx

var (
	idRE   = regexp.MustCompile(`href="/messages/(\d+)"`)
	nextRE = regexp.MustCompile(`href="([^"]+)" id="next"`)
)

// parkOne parks one message and returns its row id.
func (f *fixture[TTx]) park(t *testing.T, p parkSpec) int64 {
	t.Helper()
	m := message.NewMessage(p.uuid(), []byte(p.Payload))
	for k, v := range p.Meta {
		m.Metadata.Set(k, v)
	}
	outcome := p.Outcome
	if outcome == "" {
		outcome = settle.DeadLettered
	}
	at := p.At
	if at.IsZero() {
		at = time.Now()
	}
	err := f.parked.Park(t.Context(), settle.Parked{
		Message: m, Outcome: outcome, Cause: errors.New(p.Reason), Handler: p.Handler, Topic: p.Topic,
		Key: p.Key, Attempts: 3, FirstFailure: at.Add(-time.Second), LastFailure: at, TraceID: p.TraceID,
	})
	if err != nil {
		t.Fatal(err)
	}
	page, err := f.parked.List(t.Context(), parked.Query{Filter: parked.Filter{UUID: m.UUID}, Limit: 1})
	if err != nil || len(page.Messages) != 1 {
		t.Fatalf("the parked row of %s: %v, %d rows", m.UUID, err, len(page.Messages))
	}
	return page.Messages[0].ID
}

type parkSpec struct {
	UUID, Handler, Topic, Reason, Payload, Key, TraceID string
	Outcome                                             settle.Outcome
	Meta                                                map[string]string
	At                                                  time.Time
}

func (p parkSpec) uuid() string {
	if p.UUID != "" {
		return p.UUID
	}
	return watermill.NewUUID()
}

// client is a browser-like client: it keeps cookies, and sends the Origin
// of the server on every POST.
type client struct {
	t    *testing.T
	base string
	http *http.Client
	// header is sent with every request.
	header http.Header
}

func (f *fixture[TTx]) client(t *testing.T) *client {
	jar, _ := cookiejar.New(nil)
	return &client{t: t, base: f.srv.URL, header: http.Header{},
		http: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

// do sends a request and returns its response and body.
func (c *client) do(method, path string, form url.Values, hdr map[string]string) (*http.Response, string) {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequestWithContext(c.t.Context(), method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	for k, v := range c.header {
		req.Header[k] = v
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if method == http.MethodPost {
		req.Header.Set("Origin", c.base)
		req.Header.Set("Sec-Fetch-Site", "same-origin")
	}
	for k, v := range hdr {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return resp, string(b)
}

func (c *client) get(path string) (*http.Response, string) {
	return c.do(http.MethodGet, path, nil, nil)
}

// getOK gets path and fails the test unless it answers 200.
func (c *client) getOK(path string) string {
	c.t.Helper()
	resp, body := c.get(path)
	if resp.StatusCode != http.StatusOK {
		c.t.Fatalf("GET %s: %s\n%s", path, resp.Status, body)
	}
	return body
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrfOf returns the CSRF token of a page's form.
func csrfOf(t *testing.T, page string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token in the page:\n%s", page)
	}
	return m[1]
}

var hiddenRE = regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`)

// confirmForm returns the fields of the confirmation form of a page.
func confirmForm(t *testing.T, page string) url.Values {
	t.Helper()
	i := strings.Index(page, `id="confirm"`)
	if i < 0 {
		t.Fatalf("no confirmation form in the page:\n%s", page)
	}
	v := url.Values{}
	for _, m := range hiddenRE.FindAllStringSubmatch(page[i:], -1) {
		v.Add(m[1], html.UnescapeString(m[2]))
	}
	return v
}

// uniq returns prefix and random hex: a table name of the test's own.
func uniq(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_console_" + hex.EncodeToString(b[:])
}
