package main

import (
	"bytes"
	"fmt"
	"html"
	"io"
	"strings"
	"unicode/utf8"
)

// Everything the command prints or draws that came from outside (a
// message's headers and payload, a span from Jaeger, a driver's or broker's
// error) passes through safeLine or safeText first: a terminal acts on
// control characters (an escape sequence can retitle the window, clear the
// screen, hide a line or, on some terminals, answer back as if typed), and
// XML forbids most of them. They are shown instead, Go-style: \n, \r, \t, \x1b
// for another C0 control, DEL or a byte that is not UTF-8, \u009b for a C1 control or a
// character that reorders text (U+200E, U+200F, U+202A–U+202E,
// U+2066–U+2069).

// safeLine returns s for one line of output: every control character,
// newline and tab included, escaped.
func safeLine(s string) string { return escape(s, false) }

// safeText returns s for output that may span lines (a payload, an error):
// newlines and tabs kept, every other control character escaped.
func safeText(s string) string { return escape(s, true) }

func escape(s string, multiline bool) string {
	if clean(s, multiline) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case multiline && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20, r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		case r >= 0x80 && r <= 0x9f, bidiControl(r), r == 0xfffe, r == 0xffff:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// clean reports whether s needs no escaping.
func clean(s string, multiline bool) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x80 {
			// Decode only when there is non-ASCII text.
			for _, r := range s[i:] {
				if r == utf8.RuneError || r < 0x20 && !(multiline && (r == '\n' || r == '\t')) || r >= 0x7f && r <= 0x9f ||
					bidiControl(r) || r == 0xfffe || r == 0xffff {
					return false
				}
			}
			return utf8.ValidString(s[i:])
		}
		if c < 0x20 && !(multiline && (c == '\n' || c == '\t')) || c == 0x7f {
			return false
		}
	}
	return true
}

// bidiControl reports whether r reorders the text around it: the marks,
// embeddings, overrides and isolates of the Unicode bidirectional
// algorithm.
func bidiControl(r rune) bool {
	return r == 0x200e || r == 0x200f || r >= 0x202a && r <= 0x202e || r >= 0x2066 && r <= 0x2069
}

// svgText returns s as the text of an SVG element: escaped as safeLine
// does, then XML-escaped, so that the document is valid XML 1.0 (which
// allows no C0 control but tab, newline and carriage return, not even as a
// character reference).
func svgText(s string) string { return html.EscapeString(safeLine(s)) }

// safeJSON escapes, in JSON that encoding/json wrote, what the encoder
// leaves raw and a terminal may act on: DEL, the C1 controls and the
// characters that reorder text, as \u escapes. encoding/json already
// escapes the C0 controls and replaces invalid UTF-8.
func safeJSON(b []byte) []byte {
	if clean(string(b), true) {
		return b
	}
	var out bytes.Buffer
	out.Grow(len(b) + 16)
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		switch {
		case r == 0x7f, r >= 0x80 && r <= 0x9f, bidiControl(r), r == 0xfffe, r == 0xffff:
			fmt.Fprintf(&out, `\u%04x`, r)
		default:
			out.Write(b[i : i+n])
		}
		i += n
	}
	return out.Bytes()
}

// controlFilter is the last line of defence on stdout and stderr: it
// escapes every ASCII control byte but newline and tab, whatever printed
// it. Fields are escaped where they are printed (safeLine, safeText); this
// catches a field that was missed. It works byte by byte, which is safe
// across writes because no ASCII byte is part of a multi-byte UTF-8
// sequence.
type controlFilter struct{ w io.Writer }

func (f controlFilter) Write(p []byte) (int, error) {
	i := 0
	for i < len(p) {
		c := p[i]
		if c < 0x20 && c != '\n' && c != '\t' || c == 0x7f {
			break
		}
		i++
	}
	if i == len(p) {
		return f.w.Write(p)
	}
	var b bytes.Buffer
	b.Grow(len(p) + 8)
	for _, c := range p {
		if c < 0x20 && c != '\n' && c != '\t' || c == 0x7f {
			fmt.Fprintf(&b, `\x%02x`, c)
		} else {
			b.WriteByte(c)
		}
	}
	if _, err := f.w.Write(b.Bytes()); err != nil {
		return 0, err
	}
	return len(p), nil
}
