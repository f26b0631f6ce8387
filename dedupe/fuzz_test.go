package dedupe_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
)

// Any bytes are a key: an empty or oversized one is refused with a permanent
// *KeyError, every other one claims, confirms and then reads as a duplicate,
// and MetadataKey never panics on what a producer put in the metadata.
func FuzzKey(f *testing.F) {
	f.Add("order:17", "charge:")
	f.Add("", "")
	f.Add("\x00\xff\xfe", "'; DROP TABLE x; --")
	f.Add("ключ-🔑", "\"quoted\"")
	f.Fuzz(func(t *testing.T, key, prefix string) {
		s := dedupe.NewMemoryStore()
		ctx := t.Context()
		c, err := s.Claim(ctx, key, time.Minute)
		if key == "" || len(key) > dedupe.MaxKeyLen {
			var ke *dedupe.KeyError
			if !errors.As(err, &ke) || !ke.Permanent() {
				t.Fatalf("Claim(%q) = %v; want a permanent *KeyError", key, err)
			}
			return
		}
		if err != nil || c.Result != dedupe.Acquired {
			t.Fatalf("Claim(%q) = %+v, %v", key, c, err)
		}
		if err := s.Confirm(ctx, c); err != nil {
			t.Fatal(err)
		}
		if d, err := s.Claim(ctx, key, time.Minute); err != nil || d.Result != dedupe.Duplicate {
			t.Fatalf("second Claim(%q) = %+v, %v; want Duplicate", key, d, err)
		}

		msg := message.NewMessage("m", nil)
		msg.Metadata.Set("order_id", key)
		got, err := dedupe.MetadataKey("order_id", prefix)(msg)
		if err != nil || got != prefix+key {
			t.Fatalf("MetadataKey = %q, %v; want %q", got, err, prefix+key)
		}
	})
}
