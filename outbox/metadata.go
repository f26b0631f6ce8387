package outbox

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/mdcolumn"
)

// encodeMetadata returns the text of the metadata column for md: the JSON
// object of its strings, or settle's base64 form when a key or value is not
// valid UTF-8. The encoding is internal/mdcolumn's, shared with the
// messages tables of sqlitepubsub.
func encodeMetadata(md message.Metadata) (string, error) { return mdcolumn.Encode(md) }

// decodeMetadata reads the text of a metadata column in either form; the
// result is never nil.
func decodeMetadata(s string) (message.Metadata, error) { return mdcolumn.Decode(s) }
