package parked_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/poison"
)

// The normaliser turns the ids and values in real error texts into
// placeholders, and keeps the words that say what went wrong.
func TestNormalize(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, want string }{
		// fmt errors with ids.
		{"order 17 failed", "order <n> failed"},
		{"order 18 failed", "order <n> failed"},
		{"charge 4f3c2a1b9e8d7c6b: card declined", "charge <hex>: card declined"},
		{"message 0b9f6c52-3f1e-4d6a-9c8e-2f5b7a1d4e90: amount -12.50 exceeds limit 1e3", "message <uuid>: amount <n> exceeds limit <n>"},
		{"user alice@example.com not found (id=0x1f3a)", "user <addr> not found (id=<hex>)"},
		{`customer "ACME Corp" has no account 'A-17'`, "customer <q> has no account <q>"},
		{"can't find order 17, it isn't there", "can't find order <n>, it isn't there"},
		{"retry after 1.5s: rate limited for 2m30s (150ms left)", "retry after <dur>: rate limited for <dur> (<dur> left)"},
		{"batch at 2026-12-02T06:15:15.123Z rejected", "batch at <time> rejected"},
		{"trace 4bf92f3577b34da6a3ce929d0e0e4736 span 00f067aa0ba902b7", "trace <hex> span <hex>"},
		// net errors, as the net package prints them.
		{"dial tcp 127.0.0.1:5432: connect: connection refused", "dial tcp <addr>: connect: connection refused"},
		{"dial tcp 10.0.3.7:5432: connect: connection refused", "dial tcp <addr>: connect: connection refused"},
		{"dial tcp [::1]:5672: connect: connection refused", "dial tcp <addr>: connect: connection refused"},
		{"read tcp 10.0.0.5:43512->10.0.0.7:5672: i/o timeout", "read tcp <addr>-><addr>: i/o timeout"},
		{"lookup db-3.internal on 127.0.0.53:53: no such host", "lookup db-<n>.internal on <addr>: no such host"},
		{`Post "https://api.example.com/v1/charges/ch_123": context deadline exceeded`, "Post <q>: context deadline exceeded"},
		{"GET https://api.example.com/v1/orders/17 returned 503", "GET <url> returned <n>"},
		// PostgreSQL through pgx and lib/pq.
		{`ERROR: duplicate key value violates unique constraint "orders_pkey" (SQLSTATE 23505)`, "ERROR: duplicate key value violates unique constraint <q> (SQLSTATE 23505)"},
		{`ERROR: relation "orders_2026" does not exist (SQLSTATE 42P01)`, "ERROR: relation <q> does not exist (SQLSTATE 42P01)"},
		{`pq: duplicate key value violates unique constraint "orders_pkey"`, "pq: duplicate key value violates unique constraint <q>"},
		{"failed to connect to `user=app database=orders`: 10.1.2.3:5432 (db.internal): dial error: timeout: context deadline exceeded",
			"failed to connect to <q>: <addr> (db.internal): dial error: timeout: context deadline exceeded"},
		// MySQL.
		{"Error 1062 (23000): Duplicate entry '17' for key 'PRIMARY'", "Error <n> (<n>): Duplicate entry <q> for key <q>"},
		// encoding/json.
		{"invalid character 'x' looking for beginning of value", "invalid character <q> looking for beginning of value"},
		{"json: cannot unmarshal string into Go struct field Order.amount of type int", "json: cannot unmarshal string into Go struct field Order.amount of type int"},
		{"json: cannot unmarshal number 1e999 into Go value of type float64", "json: cannot unmarshal number <n> into Go value of type float64"},
		// Words with digits stay words.
		{"utf8: invalid sha256 sum for v2 of http2 frame", "utf8: invalid sha256 sum for v2 of http2 frame"},
		{"  spaces\tand\n\nlines  ", "spaces and lines"},
	} {
		if got := parked.Normalize(c.in); got != c.want {
			t.Errorf("Normalize(%q)\n got %q\nwant %q", c.in, got, c.want)
		}
	}
}

// One bug is one group: errors of one handler, outcome and type whose
// texts differ only by ids share a group; another handler, outcome, error
// type or text is another group. The type is the innermost error's.
func TestGroupOf(t *testing.T) {
	t.Parallel()
	_, dialErr := net.DialTimeout("tcp", "127.0.0.1:1", time.Second)
	if dialErr == nil {
		t.Skip("something listens on port 1")
	}
	var v struct{ Amount int }
	jsonErr := json.Unmarshal([]byte(`{"Amount":"17"}`), &v)
	syntaxErr := json.Unmarshal([]byte(`{x`), &v)

	g := func(handler string, o settle.Outcome, err error) string {
		id, _, _ := parked.GroupOf(handler, o, err)
		return id
	}
	same := [][2]error{
		{fmt.Errorf("order 17 failed: %w", errBoom), fmt.Errorf("order 18 failed: %w", errBoom)},
		{fmt.Errorf("charge %s: %w", "0b9f6c52-3f1e-4d6a-9c8e-2f5b7a1d4e90", syntaxErr), fmt.Errorf("charge %s: %w", "7d4e1c2b-aaaa-4d6a-9c8e-2f5b7a1d4e91", syntaxErr)},
		{poison.Permanent(fmt.Errorf("decode order 1: %w", jsonErr)), poison.Permanent(fmt.Errorf("decode order 2: %w", jsonErr))},
	}
	for _, p := range same {
		if a, b := g("h", settle.DeadLettered, p[0]), g("h", settle.DeadLettered, p[1]); a != b {
			t.Errorf("%q and %q are in groups %s and %s; want one", p[0], p[1], a, b)
		}
	}
	base := fmt.Errorf("order 17 failed: %w", errBoom)
	for name, other := range map[string]string{
		"handler": g("h2", settle.DeadLettered, base),
		"outcome": g("h", settle.Poisoned, base),
		"type":    g("h", settle.DeadLettered, fmt.Errorf("order 17 failed: %w", syntaxErr)),
		"text":    g("h", settle.DeadLettered, fmt.Errorf("order 17 refused: %w", errBoom)),
	} {
		if other == g("h", settle.DeadLettered, base) {
			t.Errorf("another %s, the same group", name)
		}
	}

	for _, c := range []struct {
		err      error
		typ, txt string
	}{
		{fmt.Errorf("connect: %w", dialErr), "syscall.Errno", "connect: dial tcp <addr>: connect: connection refused"},
		{poison.Permanent(fmt.Errorf("decode: %w", syntaxErr)), "*json.SyntaxError", ""},
		{fmt.Errorf("wrap: %w", jsonErr), "*json.UnmarshalTypeError", ""},
		{errors.Join(nil, fmt.Errorf("a: %w", syntaxErr), errBoom), "*json.SyntaxError", ""},
		{errBoom, "*errors.errorString", "boom"},
		{nil, "<nil>", ""},
	} {
		_, typ, txt := parked.GroupOf("h", settle.Poisoned, c.err)
		if typ != c.typ || c.txt != "" && txt != c.txt {
			t.Errorf("group of %v: type %q, text %q; want %q, %q", c.err, typ, txt, c.typ, c.txt)
		}
	}
	// A long text is grouped by its beginning, bounded.
	_, _, txt := parked.GroupOf("h", settle.Poisoned, errors.New(strings.Repeat("word ", 10000)))
	if len(txt) > 1024 {
		t.Errorf("group text of a 50 KB error is %d bytes; want at most 1 KiB", len(txt))
	}
}
