package console_test

import (
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// The claims page answers "was order 17 charged by handler charge?" and
// lists the claims held now, on every database.
func TestClaims(t *testing.T) {
	t.Parallel()
	for _, db := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"sqlite", func(t *testing.T) { claims(t, sqlite(t)) }},
		{"postgres", func(t *testing.T) { claims(t, testenv.Postgres(t).Driver()) }},
		{"pgx", func(t *testing.T) { claims(t, testenv.Pgx(t)) }},
		{"mysql", func(t *testing.T) { claims(t, testenv.MySQL(t).Driver()) }},
	} {
		t.Run(db.name, func(t *testing.T) { t.Parallel(); db.run(t) })
	}
}

func claims[TTx any](t *testing.T, db sqldb.Driver[TTx]) {
	f := setup(t, db, nil)
	ctx := t.Context()
	c, err := f.claims.Claim(ctx, dedupe.ScopedKey("charge", "order:17"), time.Minute)
	if err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("claim: %v %v", c.Result, err)
	}
	if err := f.claims.Confirm(ctx, c); err != nil {
		t.Fatal(err)
	}
	if c, err := f.claims.Claim(ctx, dedupe.ScopedKey("ship", "order:18"), time.Hour); err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("claim: %v %v", c.Result, err)
	}
	cl := f.client(t)
	body := cl.getOK("/claims?scope=charge&key=order:17")
	found := body[strings.Index(body, `id="found"`):]
	if !strings.Contains(found, "confirmed") || !strings.Contains(found, "<dt>Attempts</dt><dd>1</dd>") {
		t.Errorf("the lookup of a confirmed key:\n%s", found)
	}
	if inflight := body[strings.Index(body, `id="inflight"`):]; !strings.Contains(inflight, "order:18") || strings.Contains(inflight, "order:17") {
		t.Errorf("in flight shows:\n%s", inflight)
	}
	if body := cl.getOK("/claims?scope=ship&key=order:17"); !strings.Contains(body, `id="notfound"`) {
		t.Error("another handler's key is found")
	}
}

// Without a claims store there is no claims page.
func TestNoClaimsPage(t *testing.T) {
	t.Parallel()
	f := setup(t, sqlite(t), func(c *console.Config[*sqlTx]) { c.Claims = nil })
	cl := f.client(t)
	if resp, _ := cl.get("/claims"); resp.StatusCode != 404 {
		t.Errorf("GET /claims: %s, want 404", resp.Status)
	}
	if strings.Contains(cl.getOK("/"), `/claims"`) {
		t.Error("the navigation links to the claims page")
	}
}
