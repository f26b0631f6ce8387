package amqpmarshal_test

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const uuidHeader = amqp.DefaultMessageUUIDHeaderKey

func setup(t *testing.T) amqpmarshal.Marshaler {
	t.Helper()
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatalf("New(Config{}): %v", err)
	}
	return m
}

func unmarshal(t *testing.T, m amqpmarshal.Marshaler, d amqp091.Delivery) *message.Message {
	t.Helper()
	msg, err := m.Unmarshal(d)
	if err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if msg == nil {
		t.Fatal("Unmarshal returned a nil message")
	}
	return msg
}

func headerTypes(t testing.TB, md message.Metadata) map[string]string {
	t.Helper()
	raw, ok := md[amqpmarshal.MetaHeaderTypes]
	if !ok {
		return nil
	}
	var types map[string]string
	if err := json.Unmarshal([]byte(raw), &types); err != nil {
		t.Fatalf("%s = %q is not a JSON object of strings: %v", amqpmarshal.MetaHeaderTypes, raw, err)
	}
	return types
}

func TestUnmarshalNonStringHeaders(t *testing.T) {
	t.Parallel()
	plus2 := time.FixedZone("plus2", 2*3600)
	cases := []struct {
		name     string
		value    any
		wantText string
		wantType string
	}{
		{"bool true", true, "true", "bool"},
		{"bool false", false, "false", "bool"},
		{"int8", int8(-8), "-8", "int8"},
		{"uint8", uint8(200), "200", "uint8"},
		{"int16", int16(-32768), "-32768", "int16"},
		{"uint16", uint16(65535), "65535", "uint16"},
		{"int32", int32(-42), "-42", "int32"},
		{"uint32", uint32(4294967295), "4294967295", "uint32"},
		{"int64", int64(math.MinInt64), "-9223372036854775808", "int64"},
		{"int", 7, "7", "int"},
		{"float32", float32(1.1), "1.1", "float32"},
		{"float32 NaN", float32(math.NaN()), "NaN", "float32"},
		{"float64", 0.1, "0.1", "float64"},
		{"float64 large", 1e21, "1e+21", "float64"},
		{"float64 -Inf", math.Inf(-1), "-Inf", "float64"},
		{"decimal", amqp091.Decimal{Scale: 2, Value: -12345}, "-123.45", "decimal"},
		{"decimal small", amqp091.Decimal{Scale: 3, Value: 5}, "0.005", "decimal"},
		{"decimal keeps scale", amqp091.Decimal{Scale: 2, Value: 150}, "1.50", "decimal"},
		{"decimal no scale", amqp091.Decimal{Value: math.MinInt32}, "-2147483648", "decimal"},
		{"timestamp in UTC", time.Date(2024, 5, 1, 14, 0, 0, 0, plus2), "2024-05-01T12:00:00Z", "timestamp"},
		{"timestamp with nanos", time.Date(2024, 5, 1, 12, 0, 0, 500, time.UTC), "2024-05-01T12:00:00.0000005Z", "timestamp"},
		{"bytes", []byte{0, 1, 0xfe, 0xff}, "AAH+/w==", "bytes"},
		{"empty bytes", []byte{}, "", "bytes"},
		{"void", nil, "", "void"},
		{"empty table", amqp091.Table{}, "{}", "table"},
		{"empty array", []any{}, "[]", "array"},
		{
			"nested table",
			amqp091.Table{
				"s":    "<a&b>",
				"n":    int32(1),
				"f":    math.NaN(),
				"b":    false,
				"v":    nil,
				"d":    amqp091.Decimal{Scale: 1, Value: 15},
				"t":    time.Unix(0, 0),
				"x":    []byte("hi"),
				"arr":  []any{int64(2), "two", amqp091.Table{"deep": uint16(3)}},
				"tbl":  amqp091.Table{"z": 1.5, "a": true},
				"plus": math.Inf(1),
			},
			`{"arr":[2,"two",{"deep":3}],"b":false,"d":1.5,"f":"NaN","n":1,"plus":"+Inf",` +
				`"s":"<a&b>","t":"1970-01-01T00:00:00Z","tbl":{"a":true,"z":1.5},"v":null,"x":"aGk="}`,
			"table",
		},
		{"array", []any{"a", int8(1), nil, []any{true}}, `["a",1,null,[true]]`, "array"},
		{"map as table", map[string]any{"k": "v"}, `{"k":"v"}`, "table"},
		{"non-AMQP Go type", uint64(18446744073709551615), "18446744073709551615", "uint64"},
	}
	m := setup(t)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			msg := unmarshal(t, m, amqp091.Delivery{
				Headers: amqp091.Table{uuidHeader: "uuid-1", "h": c.value, "plain": "text"},
				Body:    []byte("body"),
			})
			if msg.UUID != "uuid-1" || string(msg.Payload) != "body" {
				t.Fatalf("UUID %q payload %q; want uuid-1 body", msg.UUID, msg.Payload)
			}
			if got, ok := msg.Metadata["h"]; !ok || got != c.wantText {
				t.Fatalf("metadata h = %q (present %v); want %q", got, ok, c.wantText)
			}
			if got := msg.Metadata["plain"]; got != "text" {
				t.Fatalf("string header plain = %q; want text", got)
			}
			if want := map[string]string{"h": c.wantType}; !reflect.DeepEqual(headerTypes(t, msg.Metadata), want) {
				t.Fatalf("header types %v; want %v", headerTypes(t, msg.Metadata), want)
			}
			if _, ok := msg.Metadata[uuidHeader]; ok {
				t.Fatalf("UUID header copied into metadata: %v", msg.Metadata)
			}
		})
	}
}

func TestUnmarshalStringHeadersOnly(t *testing.T) {
	t.Parallel()
	m := setup(t)
	msg := unmarshal(t, m, amqp091.Delivery{
		Headers: amqp091.Table{uuidHeader: "u", "a": "1", "b": "", "c": "{\"x\":1}"},
	})
	want := message.Metadata{"a": "1", "b": "", "c": "{\"x\":1}", settle.MetaRedelivered: "false"}
	if !maps.Equal(msg.Metadata, want) {
		t.Fatalf("metadata %v; want %v", msg.Metadata, want)
	}
}

func TestUnmarshalUUID(t *testing.T) {
	t.Parallel()
	custom, err := amqpmarshal.New(amqpmarshal.Config{MessageUUIDHeaderKey: "msg-uuid"})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name      string
		m         amqpmarshal.Marshaler
		headers   amqp091.Table
		messageID string
		wantUUID  string
		wantMeta  message.Metadata
	}{
		{"header", setup(t), amqp091.Table{uuidHeader: "from-header"}, "from-id", "from-header", message.Metadata{}},
		{"message-id fallback", setup(t), amqp091.Table{"a": "b"}, "from-id", "from-id", message.Metadata{"a": "b"}},
		{"nil headers", setup(t), nil, "from-id", "from-id", message.Metadata{}},
		{"empty header falls back", setup(t), amqp091.Table{uuidHeader: ""}, "from-id", "from-id", message.Metadata{}},
		{"both missing", setup(t), amqp091.Table{"a": "b"}, "", "", message.Metadata{"a": "b"}},
		{
			"non-string header kept as metadata", setup(t), amqp091.Table{uuidHeader: []byte("raw")}, "from-id", "from-id",
			message.Metadata{uuidHeader: "cmF3", amqpmarshal.MetaHeaderTypes: `{"` + uuidHeader + `":"bytes"}`},
		},
		{"zero value marshaler", amqpmarshal.Marshaler{}, amqp091.Table{uuidHeader: "zv"}, "", "zv", message.Metadata{}},
		{
			"custom header", custom, amqp091.Table{"msg-uuid": "c", uuidHeader: "stock"}, "", "c",
			message.Metadata{uuidHeader: "stock"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			msg := unmarshal(t, c.m, amqp091.Delivery{Headers: c.headers, MessageId: c.messageID})
			if msg.UUID != c.wantUUID {
				t.Fatalf("UUID %q; want %q", msg.UUID, c.wantUUID)
			}
			want := maps.Clone(c.wantMeta)
			want[settle.MetaRedelivered] = "false"
			if !maps.Equal(msg.Metadata, want) {
				t.Fatalf("metadata %v; want %v", msg.Metadata, want)
			}
		})
	}
}

func TestUnmarshalDeliveryFacts(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		redelivered bool
		headers     amqp091.Table
		wantRedeliv string
		wantCount   string // "" means absent
	}{
		{"first delivery, classic queue", false, nil, "false", ""},
		{"redelivered, classic queue", true, nil, "true", ""},
		{"quorum first redelivery int64", true, amqp091.Table{"x-delivery-count": int64(1)}, "true", "2"},
		{"quorum int32 zero", true, amqp091.Table{"x-delivery-count": int32(0)}, "true", "1"},
		{"first delivery: the producer's header", false, amqp091.Table{"x-delivery-count": int32(0)}, "false", ""},
		{"quorum uint8", true, amqp091.Table{"x-delivery-count": uint8(9)}, "true", "10"},
		{"max int64", true, amqp091.Table{"x-delivery-count": int64(math.MaxInt64)}, "true", "9223372036854775808"},
		{"string count is not a count", true, amqp091.Table{"x-delivery-count": "3"}, "true", ""},
		{"negative count is not a count", true, amqp091.Table{"x-delivery-count": int32(-1)}, "true", ""},
		{"producer-set count on a first delivery", false, amqp091.Table{"x-delivery-count": int32(50)}, "false", ""},
		{
			"stale settle keys ignored", false,
			amqp091.Table{settle.MetaRedelivered: "true", settle.MetaDeliveryCount: "7", amqpmarshal.MetaHeaderTypes: `{"a":"int8"}`},
			"false", "",
		},
		{
			"stale count replaced", true,
			amqp091.Table{settle.MetaDeliveryCount: int32(7), "x-delivery-count": int64(2)},
			"true", "3",
		},
	}
	classic := setup(t)
	quorum, err := amqpmarshal.New(amqpmarshal.Config{QuorumQueue: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		for _, q := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/quorum=%v", c.name, q), func(t *testing.T) {
				t.Parallel()
				m, wantCount := classic, ""
				if q {
					// Only a quorum queue's broker writes the header:
					// from any other queue it is the producer's word.
					m, wantCount = quorum, c.wantCount
				}
				checkDeliveryFacts(t, m, c.name, c.headers, c.redelivered, c.wantRedeliv, wantCount)
			})
		}
	}
}

func checkDeliveryFacts(t *testing.T, m amqpmarshal.Marshaler, name string, headers amqp091.Table, redelivered bool, wantRedeliv, wantCount string) {
	t.Helper()
	msg := unmarshal(t, m, amqp091.Delivery{Headers: headers, Redelivered: redelivered, MessageId: "id"})
	if got := msg.Metadata[settle.MetaRedelivered]; got != wantRedeliv {
		t.Fatalf("%s = %q; want %q", settle.MetaRedelivered, got, wantRedeliv)
	}
	got, ok := msg.Metadata[settle.MetaDeliveryCount]
	if wantCount == "" && ok {
		t.Fatalf("%s = %q; want absent", settle.MetaDeliveryCount, got)
	}
	if wantCount != "" && got != wantCount {
		t.Fatalf("%s = %q; want %q", settle.MetaDeliveryCount, got, wantCount)
	}
	if v, ok := headers["x-delivery-count"]; ok {
		if _, isString := v.(string); !isString && headerTypes(t, msg.Metadata)["x-delivery-count"] == "" {
			t.Fatalf("x-delivery-count type not recorded: %v", msg.Metadata)
		}
		if msg.Metadata["x-delivery-count"] == "" {
			t.Fatalf("x-delivery-count not kept as metadata: %v", msg.Metadata)
		}
	}
	if name == "stale settle keys ignored" {
		if _, ok := msg.Metadata[amqpmarshal.MetaHeaderTypes]; ok {
			t.Fatalf("stale %s kept: %v", amqpmarshal.MetaHeaderTypes, msg.Metadata)
		}
	}
}

func delivery(p amqp091.Publishing) amqp091.Delivery {
	return amqp091.Delivery{
		Headers:      p.Headers,
		Body:         p.Body,
		MessageId:    p.MessageId,
		DeliveryMode: p.DeliveryMode,
		ContentType:  p.ContentType,
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	t.Parallel()
	longUUID := strings.Repeat("u", 300)
	cases := []struct {
		name     string
		cfg      amqpmarshal.Config
		uuid     string
		metadata message.Metadata
		wantMode uint8
		wantID   string
	}{
		{"defaults", amqpmarshal.Config{}, "uuid-1", message.Metadata{"a": "1", "b": ""}, amqp091.Persistent, "uuid-1"},
		{"no metadata", amqpmarshal.Config{}, "uuid-2", message.Metadata{}, amqp091.Persistent, "uuid-2"},
		{"not persistent", amqpmarshal.Config{NotPersistent: true}, "uuid-3", message.Metadata{"k": "v"}, 0, "uuid-3"},
		{"custom UUID header", amqpmarshal.Config{MessageUUIDHeaderKey: "id"}, "uuid-4", message.Metadata{"k": "v"}, amqp091.Persistent, "uuid-4"},
		{"UUID too long for message-id", amqpmarshal.Config{}, longUUID, message.Metadata{"k": "v"}, amqp091.Persistent, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m, err := amqpmarshal.New(c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			in := message.NewMessage(c.uuid, []byte("payload \x00\xff"))
			in.Metadata = maps.Clone(c.metadata)
			// Delivery facts of an earlier hop are not published.
			in.Metadata[settle.MetaRedelivered] = "true"
			in.Metadata[settle.MetaDeliveryCount] = "5"
			in.Metadata[amqpmarshal.MetaHeaderTypes] = `{"a":"int32"}`

			p, err := m.Marshal(in)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			if p.DeliveryMode != c.wantMode || p.MessageId != c.wantID {
				t.Fatalf("delivery mode %d message-id %q; want %d %q", p.DeliveryMode, p.MessageId, c.wantMode, c.wantID)
			}
			key := c.cfg.MessageUUIDHeaderKey
			if key == "" {
				key = uuidHeader
			}
			if p.Headers[key] != c.uuid {
				t.Fatalf("UUID header %q = %v; want %q", key, p.Headers[key], c.uuid)
			}
			for _, k := range []string{settle.MetaRedelivered, settle.MetaDeliveryCount, amqpmarshal.MetaHeaderTypes} {
				if _, ok := p.Headers[k]; ok {
					t.Fatalf("header %s published: %v", k, p.Headers)
				}
			}
			if err := p.Headers.Validate(); err != nil {
				t.Fatalf("headers are not a valid AMQP table: %v", err)
			}

			out := unmarshal(t, m, delivery(p))
			if out.UUID != c.uuid || string(out.Payload) != string(in.Payload) {
				t.Fatalf("round trip: UUID %q payload %q; want %q %q", out.UUID, out.Payload, c.uuid, in.Payload)
			}
			want := maps.Clone(c.metadata)
			want[settle.MetaRedelivered] = "false"
			if !maps.Equal(out.Metadata, want) {
				t.Fatalf("round trip metadata %v; want %v", out.Metadata, want)
			}
		})
	}
}

func TestMarshalPostprocess(t *testing.T) {
	t.Parallel()
	m, err := amqpmarshal.New(amqpmarshal.Config{PostprocessPublishing: func(p amqp091.Publishing) amqp091.Publishing {
		p.ContentType = "application/json"
		return p
	}})
	if err != nil {
		t.Fatal(err)
	}
	p, err := m.Marshal(message.NewMessage("u", nil))
	if err != nil || p.ContentType != "application/json" {
		t.Fatalf("Marshal = %+v, %v; want content type set by PostprocessPublishing", p, err)
	}
}

// The stock marshaler and this one read each other's publishings.
func TestInteropWithDefaultMarshaler(t *testing.T) {
	t.Parallel()
	m := setup(t)
	stock := amqp.DefaultMarshaler{}
	in := message.NewMessage("uuid-x", []byte("p"))
	in.Metadata = message.Metadata{"k": "v"}

	ours, err := m.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	got, err := stock.Unmarshal(delivery(ours))
	if err != nil {
		t.Fatalf("stock Unmarshal of our publishing: %v", err)
	}
	if got.UUID != "uuid-x" || got.Metadata["k"] != "v" || string(got.Payload) != "p" {
		t.Fatalf("stock read %q %v %q", got.UUID, got.Metadata, got.Payload)
	}

	theirs, err := stock.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	got = unmarshal(t, m, delivery(theirs))
	if got.UUID != "uuid-x" || got.Metadata["k"] != "v" || string(got.Payload) != "p" {
		t.Fatalf("we read %q %v %q", got.UUID, got.Metadata, got.Payload)
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		cfg  amqpmarshal.Config
	}{
		{"UUID header too long", amqpmarshal.Config{MessageUUIDHeaderKey: strings.Repeat("h", 256)}},
		{"UUID header is settle_redelivered", amqpmarshal.Config{MessageUUIDHeaderKey: settle.MetaRedelivered}},
		{"UUID header is settle_delivery_count", amqpmarshal.Config{MessageUUIDHeaderKey: settle.MetaDeliveryCount}},
		{"UUID header is the types key", amqpmarshal.Config{MessageUUIDHeaderKey: amqpmarshal.MetaHeaderTypes}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := amqpmarshal.New(c.cfg)
			if !errors.Is(err, amqpmarshal.ErrInvalidConfig) {
				t.Fatalf("New(%+v) error %v; want ErrInvalidConfig", c.cfg, err)
			}
			if !strings.Contains(err.Error(), "Config.MessageUUIDHeaderKey") {
				t.Fatalf("error %q does not name the field", err)
			}
		})
	}
}

// fuzzTable decodes data into an AMQP table of every type amqp091 supports,
// nested up to a few levels: each value is a tag byte followed by its bytes.
func fuzzTable(data []byte) amqp091.Table {
	r := &fuzzReader{data: data}
	t := amqp091.Table{}
	for i := 0; len(r.data) > 0 && i < 32; i++ {
		t[r.name()] = r.value(0)
	}
	return t
}

type fuzzReader struct{ data []byte }

func (r *fuzzReader) bytes(n int) []byte {
	n = min(n, len(r.data))
	b := r.data[:n]
	r.data = r.data[n:]
	return b
}

func (r *fuzzReader) u64() uint64 {
	var b [8]byte
	copy(b[:], r.bytes(8))
	return binary.BigEndian.Uint64(b[:])
}

func (r *fuzzReader) octet() byte {
	b := r.bytes(1)
	if len(b) == 0 {
		return 0
	}
	return b[0]
}

func (r *fuzzReader) name() string {
	names := []string{"a", "x-delivery-count", uuidHeader, settle.MetaRedelivered, settle.MetaDeliveryCount, amqpmarshal.MetaHeaderTypes}
	b := r.octet()
	if int(b) < len(names) {
		return names[b]
	}
	return string(r.bytes(int(b % 16)))
}

func (r *fuzzReader) value(depth int) any {
	tag := r.octet()
	v := r.u64()
	switch tag % 18 {
	case 0:
		return v&1 == 1
	case 1:
		return int8(v)
	case 2:
		return uint8(v)
	case 3:
		return int16(v)
	case 4:
		return uint16(v)
	case 5:
		return int32(v)
	case 6:
		return uint32(v)
	case 7:
		return int64(v)
	case 8:
		return math.Float32frombits(uint32(v))
	case 9:
		return math.Float64frombits(v)
	case 10:
		return amqp091.Decimal{Scale: uint8(v >> 32), Value: int32(v)}
	case 11:
		return time.Unix(int64(v)%(1<<40), 0)
	case 12:
		return r.bytes(int(v % 32))
	case 13:
		return string(r.bytes(int(v % 32)))
	case 14:
		return nil
	case 15:
		if depth >= 4 {
			return nil
		}
		t := amqp091.Table{}
		for i := 0; i < int(v%4) && len(r.data) > 0; i++ {
			t[r.name()] = r.value(depth + 1)
		}
		return t
	default:
		if depth >= 4 {
			return nil
		}
		a := []any{}
		for i := 0; i < int(v%4) && len(r.data) > 0; i++ {
			a = append(a, r.value(depth+1))
		}
		return a
	}
}

// jsonCoerced is s as encoding/json writes it: each invalid UTF-8 byte
// becomes U+FFFD.
func jsonCoerced(s string) string {
	var b strings.Builder
	for _, r := range s {
		b.WriteRune(r)
	}
	return b.String()
}

func FuzzUnmarshalHeaders(f *testing.F) {
	f.Add([]byte{0, 7, 0, 0, 0, 0, 0, 0, 0, 1}, "", false)
	f.Add([]byte{1, 15, 0, 0, 0, 0, 0, 0, 0, 3, 0, 9, 0x7f, 0xf8, 0, 0, 0, 0, 0, 1}, "id", true)
	f.Add([]byte{2, 13, 0, 0, 0, 0, 0, 0, 0, 4, 'u', 'u', 'i', 'd'}, "id", true)
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte, messageID string, redelivered bool) {
		headers := fuzzTable(data)
		d := amqp091.Delivery{Headers: headers, MessageId: messageID, Redelivered: redelivered, Body: data}
		msg, err := m.Unmarshal(d)
		if err != nil || msg == nil {
			t.Fatalf("Unmarshal(%#v) = %v, %v", headers, msg, err)
		}

		wantUUID, _ := headers[uuidHeader].(string)
		if wantUUID == "" {
			wantUUID = messageID
		}
		if msg.UUID != wantUUID {
			t.Fatalf("UUID %q; want %q", msg.UUID, wantUUID)
		}
		if got := msg.Metadata[settle.MetaRedelivered]; got != strconv.FormatBool(redelivered) {
			t.Fatalf("%s = %q; want %v", settle.MetaRedelivered, got, redelivered)
		}

		wantTypes := map[string]string{}
		for k, v := range headers {
			switch k {
			case settle.MetaRedelivered, settle.MetaDeliveryCount, amqpmarshal.MetaHeaderTypes:
				continue
			}
			s, isString := v.(string)
			got, ok := msg.Metadata[k]
			switch {
			case isString && k == uuidHeader:
				if ok {
					t.Fatalf("string UUID header copied to metadata")
				}
			case isString:
				if got != s {
					t.Fatalf("string header %q = %q; want %q", k, got, s)
				}
			default:
				if !ok {
					t.Fatalf("header %q (%T) missing from metadata %v", k, v, msg.Metadata)
				}
				// encoding/json replaces each byte of invalid UTF-8 in a
				// name with U+FFFD, as the package documents.
				wantTypes[jsonCoerced(k)] = "?"
				switch v.(type) {
				case amqp091.Table, []any:
					if !json.Valid([]byte(got)) {
						t.Fatalf("header %q rendered as invalid JSON %q", k, got)
					}
				}
			}
		}
		types := headerTypes(t, msg.Metadata)
		if len(types) != len(wantTypes) {
			// Two names differing only in invalid bytes collide in JSON.
			t.Fatalf("types %v; want one per non-string header %v", types, wantTypes)
		}
		for k := range wantTypes {
			if types[k] == "" {
				t.Fatalf("type of %q not recorded in %v", k, types)
			}
		}

		again, _ := m.Unmarshal(d)
		if !maps.Equal(again.Metadata, msg.Metadata) {
			t.Fatalf("not deterministic: %v then %v", msg.Metadata, again.Metadata)
		}
	})
}
