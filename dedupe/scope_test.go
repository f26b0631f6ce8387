package dedupe_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
)

// splitScopedKey undoes ScopedKey, as the encoding documented there says.
func splitScopedKey(t *testing.T, stored string) (scope, key string) {
	t.Helper()
	if rest, ok := strings.CutPrefix(stored, "\x00"); ok {
		n, rest, ok := strings.Cut(rest, ":")
		size, err := strconv.Atoi(n)
		if !ok || err != nil || size < 0 || size > len(rest) {
			t.Fatalf("stored key %q: a length-prefixed form without a length", stored)
		}
		return rest[:size], rest[size:]
	}
	if scope, key, ok := strings.Cut(stored, "\x00"); ok {
		return scope, key
	}
	return "", stored
}

// Every (scope, key) pair is stored under a key of its own: the stored key
// gives back the pair. Keys stored before scopes existed (no scope, no NUL)
// and scoped keys of NUL-free scopes keep the form they always had.
func FuzzScopedKey(f *testing.F) {
	for _, p := range [][2]string{
		{"charge", "order-17"}, {"", "charge\x00order-17"}, {"", "order-17"},
		{"charge\x00order", "-17"}, {"", "\x000:charge"}, {"a", "\x00"}, {"\x00", ""}, {"12", "3"},
	} {
		f.Add(p[0], p[1])
	}
	f.Fuzz(func(t *testing.T, scope, key string) {
		stored := dedupe.ScopedKey(scope, key)
		if s, k := splitScopedKey(t, stored); s != scope || k != key {
			t.Fatalf("ScopedKey(%q, %q) = %q, which reads back as (%q, %q)", scope, key, stored, s, k)
		}
		switch {
		case scope == "" && !strings.Contains(key, "\x00"):
			if stored != key {
				t.Fatalf("unscoped key %q stored as %q, want it as it is", key, stored)
			}
		case scope != "" && !strings.Contains(scope, "\x00"):
			if stored != scope+"\x00"+key {
				t.Fatalf("ScopedKey(%q, %q) = %q, want the scope, a NUL and the key", scope, key, stored)
			}
		}
	})
}
