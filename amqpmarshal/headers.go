package amqpmarshal

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// maxJSONDepth bounds how deeply nested tables and arrays are rendered;
// deeper values become JSON null. amqp091 itself refuses frames nested more
// than 32 levels, so only a Delivery built in-process (possibly cyclic) can
// reach it.
const maxJSONDepth = 64

// headerText returns the metadata text and the type name of a non-string
// header value.
func headerText(v any) (text, typ string) {
	switch v := v.(type) {
	case nil:
		return "", "void"
	case bool:
		return strconv.FormatBool(v), "bool"
	case int8:
		return strconv.FormatInt(int64(v), 10), "int8"
	case uint8:
		return strconv.FormatUint(uint64(v), 10), "uint8"
	case int16:
		return strconv.FormatInt(int64(v), 10), "int16"
	case uint16:
		return strconv.FormatUint(uint64(v), 10), "uint16"
	case int32:
		return strconv.FormatInt(int64(v), 10), "int32"
	case uint32:
		return strconv.FormatUint(uint64(v), 10), "uint32"
	case int64:
		return strconv.FormatInt(v, 10), "int64"
	case int:
		return strconv.Itoa(v), "int"
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32), "float32"
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), "float64"
	case amqp091.Decimal:
		return decimalText(v), "decimal"
	case time.Time:
		return timeText(v), "timestamp"
	case []byte:
		return base64.StdEncoding.EncodeToString(v), "bytes"
	case amqp091.Table:
		return jsonText(jsonValue(map[string]any(v), 0)), "table"
	case map[string]any:
		return jsonText(jsonValue(v, 0)), "table"
	case []any:
		return jsonText(jsonValue(v, 0)), "array"
	}
	// Not an AMQP type: only a Delivery built in-process can carry one.
	return fmt.Sprint(v), fmt.Sprintf("%T", v)
}

func timeText(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// decimalText renders Value * 10^-Scale exactly, keeping Scale digits after
// the point: {Scale: 2, Value: -12345} is "-123.45", {Scale: 3, Value: 5}
// is "0.005".
func decimalText(d amqp091.Decimal) string {
	v := int64(d.Value)
	neg := v < 0
	if neg {
		v = -v
	}
	digits := strconv.FormatInt(v, 10)
	scale := int(d.Scale)
	if scale > 0 {
		if len(digits) <= scale {
			digits = strings.Repeat("0", scale-len(digits)+1) + digits
		}
		digits = digits[:len(digits)-scale] + "." + digits[len(digits)-scale:]
	}
	if neg {
		return "-" + digits
	}
	return digits
}

// jsonValue converts a header value to a tree encoding/json renders
// deterministically: numbers as json.Number in the same text as top-level
// headers, timestamps as RFC 3339 strings, bytes as base64 strings, decimals
// as exact JSON numbers, NaN and infinities as the strings "NaN", "+Inf",
// "-Inf" (JSON has no such numbers).
func jsonValue(v any, depth int) any {
	if depth > maxJSONDepth {
		return nil
	}
	switch v := v.(type) {
	case nil, bool, string:
		return v
	case float32:
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return strconv.FormatFloat(float64(v), 'g', -1, 32)
		}
		return json.Number(strconv.FormatFloat(float64(v), 'g', -1, 32))
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return strconv.FormatFloat(v, 'g', -1, 64)
		}
		return json.Number(strconv.FormatFloat(v, 'g', -1, 64))
	case int8, uint8, int16, uint16, int32, uint32, int64, int, amqp091.Decimal:
		text, _ := headerText(v)
		return json.Number(text)
	case time.Time:
		return timeText(v)
	case []byte:
		return base64.StdEncoding.EncodeToString(v)
	case amqp091.Table:
		return jsonTable(v, depth)
	case map[string]any:
		return jsonTable(v, depth)
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = jsonValue(e, depth+1)
		}
		return out
	}
	return fmt.Sprint(v)
}

func jsonTable(t map[string]any, depth int) map[string]any {
	out := make(map[string]any, len(t))
	for k, e := range t {
		out[k] = jsonValue(e, depth+1)
	}
	return out
}

// jsonText encodes v without HTML escaping and without a trailing newline.
// encoding/json sorts map keys, so the text is deterministic.
func jsonText(v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		// jsonValue only builds encodable trees; keep the promise not to
		// fail anyway.
		return fmt.Sprint(v)
	}
	return strings.TrimSuffix(b.String(), "\n")
}
