package replay_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/internal/replay"
)

// The UUID of a replay is fixed by (original UUID, count): the settle
// command and package parked derive the same one, and it must never change
// between versions (a replay run again by a newer settle must be the same
// message to the dedupe middleware).
func TestUUID(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		of   string
		n    int
		want string
	}{
		{"u-1", 1, "3383b952-6099-54d8-9a8f-88a5cdf54853"},
		{"", 2, "604253bf-0283-5db4-8179-c4a612058765"},
	} {
		if got := replay.UUID(c.of, "", c.n); got != c.want {
			t.Errorf("UUID(%q, %d) = %s, want %s", c.of, c.n, got, c.want)
		}
	}
	// A copy for a handler: one UUID per (original, handler, count).
	if got, want := replay.UUID("u-1", "charge", 1), "7bb85aa0-a1ed-57e8-b32d-4a2700fa55ec"; got != want {
		t.Errorf("UUID(u-1, charge, 1) = %s, want %s", got, want)
	}
	seen := map[string]bool{}
	for _, of := range []string{"", "u-1", "u-2", "u-1/replay/1", "u-1/1", "2:u-"} {
		for _, h := range []string{"", "charge", "email", "1/charge", "replay/1"} {
			for n := 1; n <= 3; n++ {
				id := replay.UUID(of, h, n)
				if seen[id] {
					t.Errorf("UUID(%q, %q, %d) = %s, already given to another (uuid, handler, count)", of, h, n, id)
				}
				seen[id] = true
				if len(id) != 36 || id[14] != '5' {
					t.Errorf("UUID(%q, %q, %d) = %s, want a version 5 UUID", of, h, n, id)
				}
			}
		}
	}
}

// The keys spelled in package replay are those of the packages that own
// them.
func TestKeysAgree(t *testing.T) {
	t.Parallel()
	for _, c := range [][2]string{
		{replay.MetaAMQPHeaderTypes, amqpmarshal.MetaHeaderTypes},
		{replay.MetaAttemptMark, park.MetaAttemptMark},
		{replay.MetaDroppedHeaders, park.MetaDroppedHeaders},
	} {
		if c[0] != c[1] {
			t.Errorf("replay spells %q, its owner %q", c[0], c[1])
		}
	}
}

// A copy is for another handler when it names one and the router handler
// running it (a pipeline's "#2" suffix stripped) is another.
func TestForAnother(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		to, running string
		want        bool
	}{
		{"charge", "charge", false},
		{"charge", "charge#2", false},
		{"charge", "email", true},
		{"charge", "email#3", true},
		{"charge#2", "charge#2", true}, // a row's handler is a scope: "charge#2" runs as "charge"
		{"", "email", false},
		{"charge", "", false}, // no router handler: nothing to compare
	} {
		md := message.Metadata{"other": "x"}
		if c.to != "" {
			md.Set(settle.MetaReplayHandler, c.to)
		}
		if _, got := replay.ForAnother(c.running, md); got != c.want {
			t.Errorf("copy for %q in handler %q: for another %v, want %v", c.to, c.running, got, c.want)
		}
	}
}
