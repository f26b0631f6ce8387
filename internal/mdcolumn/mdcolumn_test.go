package mdcolumn_test

import (
	"encoding/json"
	"errors"
	"maps"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/mdcolumn"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// seeds are metadata of the kinds the outbox and sqlitepubsub tests send.
var seeds = []map[string]string{
	{"bin": "\xff\xfe\x00\x01 raw", "\xc3\x28key": "v"},
	{"nul": "a\x00b", "\x00k": "\x00"},
	{"content_type": "application/json", "é": "ü <&> \u2028 🙂", "empty": ""},
	{"settle_metadata_base64": `{"YQ==":"Yg=="}`, "x": "y"},
	{"settle_metadata_base64": "\xff", "x": "y\x80"},
	{"a": `{"settle_metadata_base64":{"YQ==":"Yg=="}}`},
	{"\xed\xa0\x80": ""},
	{},
}

// Any metadata, of any bytes, round-trips byte for byte; metadata that is
// all valid UTF-8 is stored exactly as settle has always stored it (the
// JSON object of its strings), and the other form is ASCII.
func FuzzRoundTrip(f *testing.F) {
	for _, md := range seeds {
		var rest []byte
		for k, v := range md {
			rest = append(rest, byte(len(k)))
			rest = append(rest, k...)
			rest = append(rest, byte(len(v)))
			rest = append(rest, v...)
		}
		f.Add("k", "v", rest)
	}
	f.Add("\xff", "", []byte{})
	f.Add("", "\xff", []byte{1, 0xc0, 1, 0x80})
	f.Add("settle_metadata_base64", `{"YQ==":"Yg=="}`, []byte{1, 'a', 1, 0xff})
	f.Add("\xed\xa0\x80", "\xf4\x90\x80\x80", []byte{}) // a surrogate, a code point past U+10FFFF
	f.Add("\u2028", "<&>\x00", []byte{2, 0xc3, 0x28, 0})
	f.Fuzz(func(t *testing.T, k, v string, rest []byte) {
		md := message.Metadata{k: v}
		for len(rest) > 0 {
			n := min(int(rest[0]), len(rest)-1)
			key := string(rest[1 : 1+n])
			rest = rest[1+n:]
			var val string
			if len(rest) > 0 {
				n = min(int(rest[0]), len(rest)-1)
				val = string(rest[1 : 1+n])
				rest = rest[1+n:]
			}
			md[key] = val
		}
		col, err := mdcolumn.Encode(maps.Clone(md))
		if err != nil {
			t.Fatal(err)
		}
		got, err := mdcolumn.Decode(col)
		if err != nil {
			t.Fatalf("reading back the column %q: %v", col, err)
		}
		if !maps.Equal(got, md) {
			t.Fatalf("metadata %q came back as %q (column %q)", md, got, col)
		}
		valid := true
		for k, v := range md {
			valid = valid && utf8.ValidString(k) && utf8.ValidString(v)
		}
		if valid {
			want, _ := json.Marshal(md)
			if col != string(want) {
				t.Fatalf("metadata %q (all UTF-8) stored as %q, want %q as before", md, col, want)
			}
		} else if strings.ContainsFunc(col, func(r rune) bool { return r >= 0x80 }) || !strings.HasPrefix(col, `{"settle_metadata_base64":{`) {
			t.Fatalf("metadata %q stored as %q, want the base64 form", md, col)
		}
	})
}

// No metadata at all (a nil map) is stored as before ("null") and read as
// empty, usable metadata.
func TestNil(t *testing.T) {
	t.Parallel()
	col, err := mdcolumn.Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := mdcolumn.Decode(col)
	if err != nil || col != "null" || got == nil || len(got) != 0 {
		t.Fatalf("nil metadata: column %q, read back %q (%v); want null and an empty map", col, got, err)
	}
}

// Text in neither form is refused with ErrForm; what only looks like the
// base64 form is refused too.
func TestDecodeRefuses(t *testing.T) {
	t.Parallel()
	for _, col := range []string{
		`{"settle_metadata_base64":{"!!":"YQ=="}}`,
		`{"settle_metadata_base64":{"YQ==":"YQ"}}`,
		`{"settle_metadata_base64":{"YQ==":"Yg=="},"x":"y"}`,
		`{"settle_metadata_base64":{"YQ==":1}}`,
		`{"Settle_metadata_base64":{"YQ==":"Yg=="}}`,
		`{"a":1}`,
		`[]`,
		``,
	} {
		if md, err := mdcolumn.Decode(col); !errors.Is(err, mdcolumn.ErrForm) {
			t.Errorf("column %q: metadata %q, err %v; want ErrForm", col, md, err)
		}
	}
}
