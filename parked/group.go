package parked

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/settle-go/settle"
)

// failureGroup is what a row's failure group is made of.
type failureGroup struct {
	id, errorType, text string
}

// Bounds on a group's text: the error text read (a longer one is grouped by
// its beginning) and the normalised text kept.
const (
	maxGroupInput = 4 << 10
	maxGroupText  = 1 << 10
	maxErrorType  = 255
)

// groupOf returns the failure group of a message handler parked with
// outcome because of cause: the handler, the outcome, the Go type of the
// innermost error of cause and cause's text normalised.
func groupOf(handler string, outcome settle.Outcome, cause error) failureGroup {
	var g failureGroup
	if cause == nil {
		g.errorType, g.text = "<nil>", ""
	} else {
		g.errorType = cutRunes(clean(fmt.Sprintf("%T", innermost(cause))), maxErrorType)
		msg := cause.Error()
		if len(msg) > maxGroupInput {
			msg = cutBytes(msg, maxGroupInput)
		}
		g.text = cutBytes(normalize(clean(msg)), maxGroupText)
	}
	h := sha256.New()
	for _, part := range []string{handler, string(outcome), g.errorType, g.text} {
		fmt.Fprintf(h, "%d:%s\n", len(part), part)
	}
	g.id = hex.EncodeToString(h.Sum(nil)[:8])
	return g
}

// innermost is the error at the bottom of err's chain: each error's
// Unwrap() error followed to its end, and of an error that wraps several
// (errors.Join, fmt.Errorf with several %w) the first non-nil one's.
func innermost(err error) error {
	for depth := 0; depth < 100; depth++ {
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			next := error(nil)
			for _, e := range u.Unwrap() {
				if e != nil {
					next = e
					break
				}
			}
			if next == nil {
				return err
			}
			err = next
		default:
			next := errors.Unwrap(err)
			if next == nil {
				return err
			}
			err = next
		}
	}
	return err
}

// The normaliser's rules, applied in order: what a rule replaced is not
// seen by the rules after it. Each id or value becomes a placeholder in
// angle brackets, so that one bug is one group whatever the ids it met.
var normRules = []struct {
	re   *regexp.Regexp
	repl string
	fn   func(string) string // instead of repl, when set
}{
	// Quoted values: "…" with escapes, `…`, and '…' opened at the start
	// of a word (so that "can't … isn't" stays as it is).
	{regexp.MustCompile(`"(?:[^"\\\n]|\\.)*"`), `<q>`, nil},
	{regexp.MustCompile("`[^`\n]*`"), `<q>`, nil},
	{regexp.MustCompile(`(^|[\s(\[{=:,;])'[^'\n]*'`), `$1<q>`, nil},
	// URLs, before their parts are taken apart.
	{regexp.MustCompile(`\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s"'<>]+`), `<url>`, nil},
	// Timestamps (RFC 3339 and SQL's).
	{regexp.MustCompile(`\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|\s?[-+]\d{2}:?\d{2}(?:\s[A-Z]{3,4})?)?`), `<time>`, nil},
	// UUIDs.
	{regexp.MustCompile(`\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b`), `<uuid>`, nil},
	// Network addresses: IPv6 in brackets, IPv4, each with a port, bare
	// IPv6; e-mail addresses. (A host name's port is a number.)
	{regexp.MustCompile(`\[[0-9a-fA-F:.%a-zA-Z]*:[0-9a-fA-F:.%a-zA-Z]*\](?::\d+)?`), `<addr>`, nil},
	{regexp.MustCompile(`\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b`), `<addr>`, nil},
	{regexp.MustCompile(`\b(?:[0-9a-fA-F]{1,4}:){2,7}[0-9a-fA-F]{1,4}\b`), `<addr>`, nil},
	{regexp.MustCompile(`[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}`), `<addr>`, nil},
	// Durations as Go prints them (1.5s, 2m30s, 150ms, 3µs).
	{regexp.MustCompile(`\b\d+(?:\.\d+)?(?:h|m|s|ms|us|µs|ns)(?:\d+(?:\.\d+)?(?:h|m|s|ms|us|µs|ns))*\b`), `<dur>`, nil},
	// Hex: 0x-prefixed, and runs of 8 or more hex digits with a digit
	// among them (ids, hashes, trace ids, object ids).
	{regexp.MustCompile(`\b0[xX][0-9a-fA-F]+\b`), `<hex>`, nil},
	{regexp.MustCompile(`\b[0-9a-fA-F]*[0-9][0-9a-fA-F]*\b`), "", func(m string) string {
		if len(m) >= 16 || len(m) >= 8 && strings.ContainsAny(strings.ToLower(m), "abcdef") {
			return "<hex>"
		}
		return m // a number, for the rule after
	}},
	// Ids of other forms: a short prefix and '_' before a run with a
	// digit (ord_17, Stripe's ch_3Nk…), and runs of 12 or more letters
	// and digits with at least 3 digits (ULIDs, KSUIDs, base-62 ids).
	{regexp.MustCompile(`\b([A-Za-z]{1,16})_[A-Za-z0-9]*[0-9][A-Za-z0-9]*\b`), `${1}_<id>`, nil},
	{regexp.MustCompile(`\b[A-Za-z0-9]{12,}\b`), "", func(m string) string {
		digits := 0
		for _, r := range m {
			if r >= '0' && r <= '9' {
				digits++
			}
		}
		if digits >= 3 && digits < len(m) {
			return "<id>"
		}
		return m
	}},
	// Numbers, signed, decimal or with an exponent, standing alone (not
	// part of a word such as utf8 or sha256).
	{regexp.MustCompile(`(^|[^\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\b`), `$1<n>`, nil},
}

// sqlstate keeps PostgreSQL's SQLSTATE codes, which name a class of error
// rather than an id.
var sqlstate = regexp.MustCompile(`SQLSTATE \w{5}`)

var spaces = regexp.MustCompile(`\s+`)

// normalize returns text with the ids and values in it replaced by
// placeholders: UUIDs, hex ids, numbers, quoted strings, durations, URLs and
// network addresses; runs of white space become one space.
func normalize(text string) string {
	// Keep SQLSTATE codes out of the rules' way.
	var kept []string
	text = sqlstate.ReplaceAllStringFunc(text, func(m string) string {
		kept = append(kept, m)
		return "\x00" + string(rune('A'+len(kept)-1)) + "\x00"
	})
	for _, r := range normRules {
		if r.fn != nil {
			text = r.re.ReplaceAllStringFunc(text, r.fn)
		} else {
			text = r.re.ReplaceAllString(text, r.repl)
		}
	}
	for i, k := range kept {
		text = strings.Replace(text, "\x00"+string(rune('A'+i))+"\x00", k, 1)
	}
	return strings.TrimSpace(spaces.ReplaceAllString(text, " "))
}

// clean makes s storable in any text column: valid UTF-8 without NUL.
func clean(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// cutBytes cuts s to at most n bytes, on a rune boundary.
func cutBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// cutRunes cuts s to at most n runes.
func cutRunes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := 0
	for j := range s {
		if i == n {
			return s[:j]
		}
		i++
	}
	return s
}
