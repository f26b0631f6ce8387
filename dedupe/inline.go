package dedupe

import (
	"encoding/hex"
	"strconv"
)

// inlineArgs writes args into a MySQL statement as literals, so that the
// statement goes to the server as one text query. go-sql-driver/mysql sends
// a statement that has arguments as a prepare and an execute (two round
// trips) and a close unless the DSN says interpolateParams=true, which it
// does not by default; a claim then cost twice the round trips it needs. The
// arguments of the store's statements are keys ([]byte, written as hex
// literals, so no byte of a key can end the literal), tokens (hex strings)
// and integers. A statement with any other argument, or a string with
// another character, is left as it was, with its placeholders.
func inlineArgs(query string, args []any) (string, []any) {
	if len(args) == 0 {
		return query, args
	}
	size := len(query)
	for _, a := range args {
		switch a := a.(type) {
		case []byte:
			size += 2*len(a) + 3
		case string:
			for i := 0; i < len(a); i++ {
				if !plainByte(a[i]) {
					return query, args
				}
			}
			size += len(a) + 2
		case int, int64:
			size += 20
		default:
			return query, args
		}
	}
	b := make([]byte, 0, size)
	n := 0
	for i := 0; i < len(query); i++ {
		if query[i] != '?' {
			b = append(b, query[i])
			continue
		}
		if n == len(args) {
			return query, args // more placeholders than arguments: the driver says so
		}
		switch a := args[n].(type) {
		case []byte:
			b = append(b, "X'"...)
			b = hex.AppendEncode(b, a)
			b = append(b, '\'')
		case string:
			b = append(b, '\'')
			b = append(b, a...)
			b = append(b, '\'')
		case int:
			b = strconv.AppendInt(b, int64(a), 10)
		case int64:
			b = strconv.AppendInt(b, a, 10)
		}
		n++
	}
	if n != len(args) {
		return query, args
	}
	return string(b), nil
}

// plainByte reports whether c may stand in a quoted MySQL string literal
// as itself whatever the server's SQL mode.
func plainByte(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c == '-'
}
