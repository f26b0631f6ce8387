package outbox

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// metadataBase64Key is the one member of the metadata column's second form:
// {"settle_metadata_base64":{"<base64 key>":"<base64 value>",...}}, written
// when a key or a value of the metadata is not valid UTF-8 (a binary
// header), which JSON cannot carry: encoding/json would put U+FFFD in place
// of each such byte. Its value is an object, never a string, so it cannot be
// mistaken for a user's metadata entry of the same name (always a string,
// and written in the plain form).
const metadataBase64Key = "settle_metadata_base64"

// errMetadata says that a row's metadata column is in neither form.
var errMetadata = errors.New("outbox: metadata is neither a JSON object of strings nor settle's base64 form")

// encodeMetadata returns the text of the metadata column for md: the JSON
// object of its strings, as settle has always written it, when every key
// and value is valid UTF-8 (NUL included); otherwise the base64 form, so
// that every byte arrives as it was.
func encodeMetadata(md message.Metadata) (string, error) {
	if metadataIsUTF8(md) {
		b, err := json.Marshal(md)
		return string(b), err
	}
	enc := make(map[string]string, len(md))
	for k, v := range md {
		enc[base64.StdEncoding.EncodeToString([]byte(k))] = base64.StdEncoding.EncodeToString([]byte(v))
	}
	b, err := json.Marshal(map[string]map[string]string{metadataBase64Key: enc})
	return string(b), err
}

func metadataIsUTF8(md message.Metadata) bool {
	for k, v := range md {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return false
		}
	}
	return true
}

// decodeMetadata reads the text of a metadata column: a JSON object of
// strings (or null, read as no metadata) exactly as before the base64 form
// existed, or the base64 form. The result is never nil.
func decodeMetadata(s string) (message.Metadata, error) {
	var plain map[string]string
	perr := json.Unmarshal([]byte(s), &plain)
	if perr == nil {
		if plain == nil {
			plain = map[string]string{}
		}
		return plain, nil
	}
	var wrapped map[string]map[string]string
	if err := json.Unmarshal([]byte(s), &wrapped); err != nil {
		return nil, fmt.Errorf("%w: %w", errMetadata, perr)
	}
	enc, ok := wrapped[metadataBase64Key]
	if len(wrapped) != 1 || !ok || enc == nil {
		return nil, fmt.Errorf("%w: %w", errMetadata, perr)
	}
	md := make(message.Metadata, len(enc))
	for ek, ev := range enc {
		k, err := base64.StdEncoding.Strict().DecodeString(ek)
		if err != nil {
			return nil, fmt.Errorf("%w: key %q of %s: %w", errMetadata, ek, metadataBase64Key, err)
		}
		v, err := base64.StdEncoding.Strict().DecodeString(ev)
		if err != nil {
			return nil, fmt.Errorf("%w: value of key %q of %s: %w", errMetadata, ek, metadataBase64Key, err)
		}
		md[string(k)] = string(v)
	}
	return md, nil
}
