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
