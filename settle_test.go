package settle_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
)

func TestAttempt(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]int{"": 1, "1": 1, "3": 3, "0": 1, "-2": 1, "x": 1, "12": 12} {
		m := message.NewMessage("m", nil)
		if v != "" {
			m.Metadata.Set(settle.MetaAttempt, v)
		}
		if got := settle.Attempt(m); got != want {
			t.Errorf("Attempt with %q = %d, want %d", v, got, want)
		}
	}
}

func TestMetadataCarrier(t *testing.T) {
	t.Parallel()
	md := message.Metadata{}
	c := settle.MetadataCarrier(md)
	c.Set("traceparent", "00-abc")
	if md.Get("traceparent") != "00-abc" || c.Get("traceparent") != "00-abc" || len(c.Keys()) != 1 {
		t.Fatalf("carrier did not write through to the metadata: %v", md)
	}
}
