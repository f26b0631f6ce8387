// Package jsonsize bounds what indenting a JSON document costs, before
// json.Indent is asked to do it: the parked commands of cmd/settle and the
// payload page of package console both indent payloads they did not write.
//
// Deep nesting multiplies a payload: every line json.Indent starts is
// indented as deep as its level, so 44 KB of "[[[…0,0,0…]]]" is hundreds of
// megabytes indented. IndentedSize counts that in one pass without
// allocating, so a caller can show such a payload as it is instead.
package jsonsize

// IndentedSize bounds the size of p (valid JSON) indented by two spaces a
// level: every bracket and comma starts a line indented as deep as the
// deepest level, and every colon gains a space. It never counts less than
// json.Indent(dst, p, "", "  ") writes; for p that is not valid JSON the
// number means nothing.
func IndentedSize(p []byte) int {
	depth, deepest, lines, colons := 0, 0, 0, 0
	inString, escaped := false, false
	for _, c := range p {
		if inString {
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
			continue
		}
		switch c {
		case '"':
			inString = true
		case '[', '{':
			depth++
			deepest = max(deepest, depth)
			lines += 2
		case ']', '}':
			depth--
		case ',':
			lines++
		case ':':
			colons++
		}
	}
	return len(p) + colons + lines*(1+2*deepest)
}
