package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/sqldb"
)

// settle dedupe show answers "was order 17 charged by handler charge, when,
// after how many attempts?" in words, for each state of a key, on every
// database and driver; a shared scope is named with -scope; a key never
// claimed is an error. settle dedupe inflight lists the live claims.
func TestDedupeShowAndInFlight(t *testing.T) {
	t.Parallel()
	for _, tc := range pruneDatabases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			u := tc.url(t)
			db, dialect := openTestDB(t, u)
			table := shortName("cli_dds_")
			createFromSchema(t, db, "dedupe", "schema", "-dialect", dialect, "-table", table)
			q := `"` + table + `"`
			if dialect == "mysql" {
				q = "`" + table + "`"
			}
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+q) })
			store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.Dialect(dialect)), dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			ctx := t.Context()
			claim := func(scope, key string, ttl time.Duration) dedupe.Claim {
				t.Helper()
				c, err := store.Claim(ctx, dedupe.ScopedKey(scope, key), ttl)
				if err != nil || c.Result != dedupe.Acquired {
					t.Fatalf("claim %s/%s: %+v %v", scope, key, c, err)
				}
				return c
			}
			// order-17: failed once, then charged.
			if err := store.Release(ctx, claim("charge", "order-17", time.Minute)); err != nil {
				t.Fatal(err)
			}
			if err := store.Confirm(ctx, claim("charge", "order-17", time.Minute)); err != nil {
				t.Fatal(err)
			}
			// order-18: failed, released.
			if err := store.Release(ctx, claim("charge", "order-18", time.Minute)); err != nil {
				t.Fatal(err)
			}
			claim("charge", "order-19", time.Hour)        // running
			claim("charge", "order-20", time.Millisecond) // ran out
			claim("notify", "order-17\x1b[2J", time.Hour) // a hostile key, running
			claim("payments", "order-21", time.Hour)      // a shared scope
			time.Sleep(20 * time.Millisecond)

			show := func(want int, args ...string) string {
				t.Helper()
				a := append(append([]string{"dedupe", "show", "-db", u, "-table", table}, tc.driver...), args...)
				r := mustRun(t, want, a...)
				return r.stdout + r.stderr
			}
			stamp := `\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`
			for _, c := range []struct {
				args []string
				want string
			}{
				{[]string{"-handler", "charge", "-key", "order-17"}, `^key "order-17" of handler charge: done\. Confirmed at ` + stamp + ` \(\d+s ago\), after 2 attempts; first attempt at ` + stamp},
				{[]string{"-handler", "charge", "-key", "order-18"}, `^key "order-18" of handler charge: not done\. The last run failed and released the key at ` + stamp + `.*after 1 attempt;.*a redelivery runs it again`},
				{[]string{"-handler", "charge", "-key", "order-19"}, `^key "order-19" of handler charge: running now\. Claimed at ` + stamp + `.*attempt 1;.*runs out at ` + stamp + ` \(in (59m|1h)`},
				{[]string{"-handler", "charge", "-key", "order-20"}, `^key "order-20" of handler charge: not done\. A claim taken at .* ran out at .* without a confirmation.* 1 attempt so far`},
				{[]string{"-scope", "payments", "-key", "order-21"}, `^key "order-21" of scope "payments": running now`},
				{[]string{"-handler", "notify", "-key", "order-17\x1b[2J"}, `^key "order-17\\x1b\[2J" of handler notify: running now`},
			} {
				out := show(exitOK, c.args...)
				if !regexp.MustCompile(c.want).MatchString(out) {
					t.Errorf("dedupe show %q:\n%s\nwant /%s/", c.args, out, c.want)
				}
				assertSafe(t, "dedupe show", out)
			}
			if out := show(exitFail, "-handler", "refund", "-key", "order-17"); !strings.Contains(out, `key "order-17" of handler refund: no record in `+table) {
				t.Errorf("a key of another handler:\n%s", out)
			}
			show(exitUsage, "-key", "order-17")
			show(exitUsage, "-handler", "charge")
			show(exitUsage, "-handler", "charge", "-scope", "x", "-key", "k")

			r := mustRun(t, exitOK, append([]string{"dedupe", "inflight", "-db", u, "-table", table}, tc.driver...)...)
			assertSafe(t, "dedupe inflight", r.stdout)
			lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
			if len(lines) != 4 || !strings.HasPrefix(lines[1], "charge ") || !strings.Contains(lines[1], "order-19") ||
				!strings.Contains(lines[2], `order-17\x1b[2J`) || !strings.Contains(lines[3], "order-21") {
				t.Fatalf("dedupe inflight: want the three live claims, oldest first:\n%v", r)
			}
		})
	}
}
