// Package mdcolumn is the text of a message's metadata in a SQL column, one
// encoding shared by the outbox table (package outbox) and the messages
// tables of package sqlitepubsub, so a row written by either reads the same.
//
// The column holds the JSON object of the metadata's strings when every key
// and value is valid UTF-8 (NUL included), as settle has always written it.
// JSON cannot carry other bytes (encoding/json would put U+FFFD in place of
// each), so metadata with a key or value that is not valid UTF-8, a binary
// header, is written in a second form, ASCII only:
//
//	{"settle_metadata_base64":{"<base64 key>":"<base64 value>",...}}
//
// Its one member's value is an object, never a string, so it cannot be
// mistaken for a user's metadata entry of the same name (always a string,
// and written in the plain form).
package mdcolumn

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// base64Key is the one member of the second form.
const base64Key = "settle_metadata_base64"

// ErrForm says that a column's text is in neither form. Callers add which
// row it was.
var ErrForm = errors.New("metadata is neither a JSON object of strings nor settle's base64 form")

// Encode returns the column text for md: the plain JSON object when every
// key and value is valid UTF-8, otherwise the base64 form, so that every
// byte arrives as it was. A nil md is written as null.
func Encode(md message.Metadata) (string, error) {
	if isUTF8(md) {
		b, err := json.Marshal(md)
		return string(b), err
	}
	enc := make(map[string]string, len(md))
	for k, v := range md {
		enc[base64.StdEncoding.EncodeToString([]byte(k))] = base64.StdEncoding.EncodeToString([]byte(v))
	}
	b, err := json.Marshal(map[string]map[string]string{base64Key: enc})
	return string(b), err
}

func isUTF8(md message.Metadata) bool {
	for k, v := range md {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return false
		}
	}
	return true
}

// Decode reads a column's text: a JSON object of strings (or null, read as
// no metadata) exactly as encoding/json reads it, or the base64 form.
// Anything else is an error wrapping [ErrForm]. The result is never nil.
func Decode(s string) (message.Metadata, error) {
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
		return nil, fmt.Errorf("%w: %w", ErrForm, perr)
	}
	enc, ok := wrapped[base64Key]
	if len(wrapped) != 1 || !ok || enc == nil {
		return nil, fmt.Errorf("%w: %w", ErrForm, perr)
	}
	md := make(message.Metadata, len(enc))
	for ek, ev := range enc {
		k, err := base64.StdEncoding.Strict().DecodeString(ek)
		if err != nil {
			return nil, fmt.Errorf("%w: key %q of %s: %w", ErrForm, ek, base64Key, err)
		}
		v, err := base64.StdEncoding.Strict().DecodeString(ev)
		if err != nil {
			return nil, fmt.Errorf("%w: value of key %q of %s: %w", ErrForm, ek, base64Key, err)
		}
		md[string(k)] = string(v)
	}
	return md, nil
}
