package replay_test

import (
	"testing"

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
		if got := replay.UUID(c.of, c.n); got != c.want {
			t.Errorf("UUID(%q, %d) = %s, want %s", c.of, c.n, got, c.want)
		}
	}
	seen := map[string]bool{}
	for _, of := range []string{"", "u-1", "u-2", "u-1/replay/1"} {
		for n := 1; n <= 3; n++ {
			id := replay.UUID(of, n)
			if seen[id] {
				t.Errorf("UUID(%q, %d) = %s, already given to another (uuid, count)", of, n, id)
			}
			seen[id] = true
			if len(id) != 36 || id[14] != '5' {
				t.Errorf("UUID(%q, %d) = %s, want a version 5 UUID", of, n, id)
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
