package sqlurl

import (
	"net/url"
	"regexp"
	"strings"
)

// redacted is what stands where a secret was.
const redacted = "xxxxx"

// Redact returns s with every password and token replaced by xxxxx, whatever
// form s has, including forms that do not parse:
//
//   - URLs (postgres://, mysql://, amqp://, http://, ...): the password of the
//     user information, taken up to the last @ so that an unencoded / ? # or
//     @ in a password is hidden too, and the value of every query parameter
//     whose name says it is a secret (password, sslpassword, token,
//     access_token, api_key, secret, ...);
//   - go-sql-driver DSNs, user:password@tcp(host:3306)/db: the password, up
//     to the last @;
//   - libpq key=value strings, password=... or password='...': the value of
//     every key whose name says it is a secret.
//
// It errs on the side of hiding: a string it cannot read is redacted from
// the first place a secret may start. Use it on every connection string that
// goes into a message, before the message is built.
func Redact(s string) string {
	if scheme, rest, ok := strings.Cut(s, "://"); ok && validScheme(scheme) {
		return scheme + "://" + redactURLRest(rest)
	}
	// Key=value pairs first: a value may hold an @ and a colon.
	s = redactPairs(s)
	return redactUserinfo(s)
}

// validScheme reports whether s can be a URL scheme (RFC 3986).
func validScheme(s string) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
		case i > 0 && (c >= '0' && c <= '9' || c == '+' || c == '-' || c == '.'):
		default:
			return false
		}
	}
	return true
}

// redactURLRest redacts what follows "scheme://".
func redactURLRest(rest string) string {
	rest = redactUserinfo(rest)
	// The query starts at the first ? after the host (the user information,
	// where a ? may be part of a password, is already redacted).
	q := strings.IndexByte(rest, '?')
	if q < 0 {
		return rest
	}
	query, frag, hasFrag := strings.Cut(rest[q+1:], "#")
	parts := strings.Split(query, "&")
	for i, p := range parts {
		k, _, ok := strings.Cut(p, "=")
		if ok && secretKey(k) {
			parts[i] = k + "=" + redacted
		}
	}
	out := rest[:q+1] + strings.Join(parts, "&")
	if hasFrag {
		out += "#" + frag
	}
	return out
}

// redactUserinfo hides the password of "user:password@..." at the start of
// s: everything between the first colon and the last @. The last @ is where
// hosts start, since no host holds one; an @ later in s (a query value)
// hides more than the password, never less.
func redactUserinfo(s string) string {
	at := strings.LastIndexByte(s, '@')
	if at < 0 {
		return s
	}
	user, _, ok := strings.Cut(s[:at], ":")
	if !ok {
		return s
	}
	return user + ":" + redacted + s[at:]
}

// pairValue matches key=value pairs of libpq connection strings whose key
// names a secret, the value bare or single-quoted (with \' and \\ inside,
// unterminated up to the end).
var pairValue = regexp.MustCompile(`(?is)([A-Za-z_][\w.-]*)(\s*=\s*)('(?:[^'\\]|\\.)*(?:'|\\?$)|\S*)`)

func redactPairs(s string) string {
	return pairValue.ReplaceAllStringFunc(s, func(m string) string {
		sub := pairValue.FindStringSubmatch(m)
		if !secretKey(sub[1]) {
			return m
		}
		return sub[1] + sub[2] + redacted
	})
}

// secretKey reports whether a parameter named k holds a secret.
func secretKey(k string) bool {
	if u, err := url.QueryUnescape(k); err == nil {
		k = u
	}
	k = strings.ToLower(strings.TrimSpace(k))
	for _, w := range []string{"pass", "pwd", "secret", "token", "apikey", "api_key", "api-key", "auth", "credential", "signature"} {
		if strings.Contains(k, w) {
			return true
		}
	}
	switch k {
	case "key", "sig", "access_key", "private_key":
		return true
	}
	return false
}

// Scrub returns msg with every secret of dsn (as Redact finds them, in the
// form given and percent-decoded) replaced by xxxxx: for messages that
// others built from dsn, such as a driver's connection error. Secrets of
// fewer than 4 characters are left, since replacing them would mangle the
// message; Redact hides them where the DSN itself is shown.
func Scrub(msg, dsn string) string {
	for _, s := range secrets(dsn) {
		if len(s) >= 4 {
			msg = strings.ReplaceAll(msg, s, redacted)
		}
	}
	return msg
}

// secrets returns the secrets of dsn: what Redact replaces, with the
// percent-decoded forms.
func secrets(dsn string) []string {
	var out []string
	add := func(s string) {
		if s == "" {
			return
		}
		out = append(out, s)
		if u, err := url.PathUnescape(s); err == nil && u != s {
			out = append(out, u)
		}
		if u, err := url.QueryUnescape(s); err == nil && u != s {
			out = append(out, u)
		}
	}
	rest := dsn
	if scheme, r, ok := strings.Cut(dsn, "://"); ok && validScheme(scheme) {
		rest = r
		if q := strings.IndexByte(rest[max(strings.LastIndexByte(rest, '@'), 0):], '?'); q >= 0 {
			query := rest[max(strings.LastIndexByte(rest, '@'), 0)+q+1:]
			query, _, _ = strings.Cut(query, "#")
			for _, p := range strings.Split(query, "&") {
				if k, v, ok := strings.Cut(p, "="); ok && secretKey(k) {
					add(v)
				}
			}
		}
	} else {
		for _, sub := range pairValue.FindAllStringSubmatch(dsn, -1) {
			if secretKey(sub[1]) {
				v := sub[3]
				add(v)
				if strings.HasPrefix(v, "'") {
					add(strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'"))
				}
			}
		}
	}
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
			add(pw)
		}
	}
	return out
}

// scrubbed is an error whose text has the secrets of a DSN scrubbed out;
// it unwraps to the original error.
type scrubbed struct {
	err error
	msg string
}

func (e *scrubbed) Error() string { return e.msg }
func (e *scrubbed) Unwrap() error { return e.err }

// ScrubError returns err with its text scrubbed of dsn's secrets (Scrub),
// or nil. errors.Is and errors.As still see the original error.
func ScrubError(err error, dsn string) error {
	if err == nil {
		return nil
	}
	msg := Scrub(err.Error(), dsn)
	if msg == err.Error() {
		return err
	}
	return &scrubbed{err: err, msg: msg}
}
