package dedupe_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// Lookup answers "was order 17 charged by handler charge, when, after how
// many attempts?" from the claims table, through every state a key goes
// through, on every database and driver; InFlight lists the live claims
// oldest first, with their scope and key split back apart, and leaves out
// expired claims and settled keys.
func TestLookupAndInFlight(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			inspectCase(t, db.Driver(), testenv.DedupeTable(t, db))
		})
	}
	t.Run("postgres-pgx", func(t *testing.T) {
		t.Parallel()
		db := testenv.Postgres(t)
		inspectCase[pgx.Tx](t, testenv.Pgx(t), testenv.DedupeTable(t, db))
	})
}

func inspectCase[TTx any](t *testing.T, drv sqldb.Driver[TTx], table string) {
	ctx := t.Context()
	s, err := dedupe.NewSQLStore(drv, dedupe.SQLConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	lookup := func(scope, key string) (dedupe.KeyState, bool) {
		t.Helper()
		st, found, err := s.Lookup(ctx, scope, key)
		if err != nil {
			t.Fatalf("Lookup(%q, %q): %v", scope, key, err)
		}
		return st, found
	}
	if _, found := lookup("charge", "order-17"); found {
		t.Fatal("Lookup of a key never claimed: found")
	}

	before := time.Now().Add(-time.Minute) // clocks of servers may differ a little
	k := dedupe.ScopedKey("charge", "order-17")
	c, err := s.Claim(ctx, k, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	st, found := lookup("charge", "order-17")
	if !found || st.State != "claimed" || st.Attempts != 1 || st.Scope != "charge" || st.Key != "order-17" {
		t.Fatalf("after a claim: %+v found=%v", st, found)
	}
	if st.FirstAttempt.Before(before) || st.Expires.Before(st.FirstAttempt.Add(59*time.Minute)) {
		t.Fatalf("after a claim of an hour: first %v, expires %v", st.FirstAttempt, st.Expires)
	}
	first := st.FirstAttempt
	if err := s.Release(ctx, c); err != nil {
		t.Fatal(err)
	}
	if st, _ := lookup("charge", "order-17"); st.State != "released" || st.Attempts != 1 || !st.Expires.IsZero() {
		t.Fatalf("after a release: %+v", st)
	}
	c, err = s.Claim(ctx, k, time.Hour)
	if err != nil || c.Result != dedupe.Acquired {
		t.Fatalf("second claim: %+v, %v", c, err)
	}
	if err := s.Confirm(ctx, c); err != nil {
		t.Fatal(err)
	}
	st, _ = lookup("charge", "order-17")
	if st.State != "confirmed" || st.Attempts != 2 || !st.Expires.IsZero() || !st.FirstAttempt.Equal(first) || st.Updated.Before(first) {
		t.Fatalf("after the second run confirmed: %+v (first attempt %v)", st, first)
	}
	// The scope is part of the key: another handler's, the unscoped key and
	// a shared scope named like the handler with a NUL are other keys.
	for _, sk := range [][2]string{{"refund", "order-17"}, {"", "order-17"}, {"", "charge\x00order-17"}, {"charge\x00", "order-17"}} {
		if st, found := lookup(sk[0], sk[1]); found {
			t.Fatalf("Lookup(%q, %q) found %+v: another scope's key", sk[0], sk[1], st)
		}
	}

	// In flight: live claims only, oldest first, scope and key split back.
	live := [][2]string{
		{"charge", "order-18"},
		{"", "plain"},
		{"a\x00b", "k\x00ey"},      // a scope holding a NUL
		{"", "x\x00y"},             // an unscoped key holding a NUL
		{"bin", "\xff\xfe\x1b[2J"}, // bytes that are no UTF-8
	}
	for _, sk := range live {
		if c, err := s.Claim(ctx, dedupe.ScopedKey(sk[0], sk[1]), time.Hour); err != nil || c.Result != dedupe.Acquired {
			t.Fatalf("claim %q: %+v, %v", sk, c, err)
		}
		time.Sleep(2 * time.Millisecond) // distinct claim times, whatever the clock's grain
	}
	if _, err := s.Claim(ctx, dedupe.ScopedKey("charge", "expired"), time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	got, err := s.InFlight(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(live) {
		t.Fatalf("InFlight = %+v; want the %d live claims", got, len(live))
	}
	for i, sk := range live {
		if got[i].Scope != sk[0] || got[i].Key != sk[1] || got[i].State != "claimed" || got[i].Attempts != 1 || got[i].Expires.IsZero() {
			t.Errorf("InFlight[%d] = %+v; want scope %q key %q claimed", i, got[i], sk[0], sk[1])
		}
		if st, found := lookup(sk[0], sk[1]); !found || st.State != "claimed" {
			t.Errorf("Lookup(%q) = %+v, %v", sk, st, found)
		}
	}
	if got, err := s.InFlight(ctx, 2); err != nil || len(got) != 2 || got[0].Key != "order-18" {
		t.Fatalf("InFlight(2) = %+v, %v; want the two oldest", got, err)
	}
	if _, err := s.InFlight(ctx, 0); err == nil {
		t.Fatal("InFlight(0): no error")
	}
	if _, _, err := s.Lookup(ctx, "", ""); err == nil {
		t.Fatal("Lookup of an empty key: no error")
	}
}
