package dedupe

import (
	"slices"
	"testing"
)

func TestInlineArgs(t *testing.T) {
	for _, c := range []struct {
		name, query string
		args        []any
		want        string
		kept        bool // the statement keeps its placeholders and arguments
	}{
		{"key token and integer", "UPDATE t SET a = ? WHERE `key` = ? AND token = ?", []any{int64(-5), []byte("k\x00'\\\""), "0af9"},
			"UPDATE t SET a = -5 WHERE `key` = X'6b00275c22' AND token = '0af9'", false},
		{"int", "SELECT ? ", []any{7}, "SELECT 7 ", false},
		{"empty token", "SELECT ?", []any{""}, "SELECT ''", false},
		{"no arguments", "SELECT 1", nil, "SELECT 1", false},
		{"string that needs quoting", "SELECT ?", []any{"a'b"}, "", true},
		{"backslash", "SELECT ?", []any{`a\`}, "", true},
		{"other type", "SELECT ?", []any{1.5}, "", true},
		{"nil", "SELECT ?", []any{nil}, "", true},
		{"fewer placeholders", "SELECT ?", []any{1, 2}, "", true},
		{"more placeholders", "SELECT ?, ?", []any{1}, "", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			q, args := inlineArgs(c.query, c.args)
			if c.kept {
				if q != c.query || !slices.Equal(args, c.args) {
					t.Fatalf("got %q %v, want the statement kept as it was", q, args)
				}
				return
			}
			if q != c.want || len(args) != 0 {
				t.Fatalf("got %q %v, want %q and no arguments", q, args, c.want)
			}
		})
	}
}

func TestMariaDBReturning(t *testing.T) {
	for v, want := range map[string]bool{
		"10.11.19-MariaDB-0+deb12u1": true,
		"10.5.0-MariaDB":             true,
		"11.4.2-MariaDB-log":         true,
		"10.4.34-MariaDB":            false,
		"8.0.36":                     false,
		"8.4.0-MySQL":                false,
		"MariaDB":                    false,
	} {
		if got := mariaDBReturning(v); got != want {
			t.Errorf("mariaDBReturning(%q) = %v, want %v", v, got, want)
		}
	}
}
