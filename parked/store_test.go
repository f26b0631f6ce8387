package parked_test

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// A row reads back as it was parked, whatever its bytes: a payload of
// several MiB, a metadata value of 1 MiB, invalid UTF-8 in keys and values,
// markup in the reason, no UUID.
func TestRoundTripHostileRows(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		big := 10 << 20
		if e.db.Dialect == sqldb.MySQL {
			big = 6 << 20 // within the server's max_allowed_packet (16 MiB here), with the metadata
		}
		payload := bytes.Repeat([]byte{0, 0xff, 'x', 0xc3}, big/4)
		md := message.Metadata{
			"huge":             strings.Repeat("v", 1<<20),
			"bad\xff\xfekey":   "bad\xc3value\x00nul",
			"settle_reason":    "forged",
			"<script>":         "</script><script>alert(1)</script>",
			"":                 "empty key",
			"emoji \U0001F600": "ok",
		}
		cases := []struct {
			name string
			msg  *message.Message
			p    func(*settle.Parked)
		}{
			{"huge", &message.Message{UUID: "u-huge", Payload: payload, Metadata: md}, nil},
			{"no uuid", &message.Message{UUID: "", Payload: []byte("no uuid"), Metadata: message.Metadata{}}, nil},
			// Incompressible, so that PostgreSQL cannot fit them in an
			// index entry by compressing them.
			{"long uuid and key", &message.Message{UUID: noise(20000), Payload: []byte("x"), Metadata: message.Metadata{}}, func(p *settle.Parked) {
				p.Key = noise(30000)
				p.Handler = strings.Repeat("h\U0001F600", 2000) // cut to 600 characters
				p.Topic = strings.Repeat("t\U0001F600", 300)
			}},
			{"markup reason", &message.Message{UUID: "u-<script>\xff", Payload: []byte{}, Metadata: message.Metadata{}}, func(p *settle.Parked) {
				p.Cause = errors.New("<script>alert('x')</script> \xff\x00 failed")
				p.Key = "key\xff\x00<b>"
				p.Handler = "h<script>"
				p.TraceID = "0123456789abcdef0123456789abcdef"
			}},
		}
		for _, c := range cases {
			p := settle.Parked{Message: c.msg, Outcome: settle.Poisoned, Cause: errBoom, Handler: "h " + c.name, Topic: "t " + c.name,
				Attempts: 2, FirstFailure: time.UnixMicro(1_700_000_000_000_001), LastFailure: time.UnixMicro(1_700_000_000_500_002)}
			if c.p != nil {
				c.p(&p)
			}
			e.park(t, p)
			page, err := e.List(t.Context(), parked.Query{Filter: parked.Filter{UUID: c.msg.UUID, Key: p.Key, Handler: p.Handler}})
			if err != nil || len(page.Messages) != 1 {
				t.Fatalf("%s: List by UUID = %d rows, %v; want 1", c.name, len(page.Messages), err)
			}
			if page.Messages[0].Payload != nil || page.Messages[0].Metadata != nil {
				t.Errorf("%s: List returned the payload or metadata; want them left to Get", c.name)
			}
			m, err := e.Get(t.Context(), page.Messages[0].ID)
			if err != nil {
				t.Fatal(err)
			}
			if m.UUID != c.msg.UUID || !bytes.Equal(m.Payload, c.msg.Payload) || !maps.Equal(m.Metadata, c.msg.Metadata) {
				t.Errorf("%s: the row does not read back as parked: uuid %q (want %q), payload %d bytes equal=%v, metadata equal=%v",
					c.name, m.UUID, c.msg.UUID, len(m.Payload), bytes.Equal(m.Payload, c.msg.Payload), maps.Equal(m.Metadata, c.msg.Metadata))
			}
			if m.Key != p.Key || m.Outcome != settle.Poisoned || m.Attempts != 2 || m.State != parked.StateParked || m.Topic != p.Topic ||
				!m.FirstFailure.Equal(p.FirstFailure) || !m.LastFailure.Equal(p.LastFailure) || m.TraceID != p.TraceID {
				t.Errorf("%s: row %+v", c.name, m)
			}
			if want := strings.ToValidUTF8(strings.ReplaceAll(p.Cause.Error(), "\x00", "\uFFFD"), "\uFFFD"); m.Reason != want {
				t.Errorf("%s: reason %q, want %q", c.name, m.Reason, want)
			}
		}
		if _, err := e.Get(t.Context(), 1<<40); !errors.Is(err, parked.ErrNotFound) {
			t.Errorf("Get of no row = %v, want ErrNotFound", err)
		}
		e.checkGroups(t)
	})
}

// Park is idempotent for one handler and message: parked again, the row
// takes the new failure and the counts stay; another handler's park of the
// same message is a row of its own.
func TestParkIdempotent(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		p := parkedMsg("u-1", "charge", fmt.Errorf("order 17 failed: %w", errBoom))
		e.park(t, p)
		p2 := p
		p2.Attempts, p2.Cause, p2.LastFailure = 5, fmt.Errorf("order 17 failed again: %w", errBoom), p.LastFailure.Add(time.Second)
		e.park(t, p2)
		e.park(t, p2)
		rows := e.all(t, parked.Filter{})
		if len(rows) != 1 || rows[0].Attempts != 5 || rows[0].Reason != p2.Cause.Error() || !rows[0].LastFailure.Equal(p2.LastFailure.Truncate(time.Microsecond)) ||
			!rows[0].FirstFailure.Equal(p.FirstFailure.Truncate(time.Microsecond)) {
			t.Fatalf("rows after parking one message three times: %+v", rows)
		}
		gs := e.groupsByID(t)
		if len(gs) != 1 || gs[rows[0].Group].Parked != 1 || gs[rows[0].Group].Total != 1 {
			t.Fatalf("groups after parking one message three times (moved to a new group): %+v", gs)
		}
		// Another handler: another row.
		p3 := p
		p3.Handler = "ship"
		e.park(t, p3)
		if n, _ := e.Count(t.Context(), parked.Filter{UUID: "u-1"}); n != 2 {
			t.Fatalf("rows of u-1 after a second handler parked it: %d, want 2", n)
		}
		e.checkGroups(t)
	})
}

// Parks of the same messages racing on separate pools (a delivery parked
// again on redelivery while the first park is in flight) make one row per
// message, and the counts add each once.
func TestConcurrentParks(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		const workers, n = 4, 25
		hs := make([]handle, workers)
		for i := range hs {
			hs[i] = e.another(t)
		}
		var wg sync.WaitGroup
		for w, h := range hs {
			wg.Go(func() {
				for i := range n {
					// Two kinds of error per message, so that a park
					// again also moves rows between groups.
					p := parkedMsg(fmt.Sprintf("m%d", i), "charge", fmt.Errorf("kind %d: %w", (i+w)%2, errBoom))
					if err := h.Park(t.Context(), p); err != nil {
						t.Error(err)
						return
					}
					time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond)
				}
			})
		}
		wg.Wait()
		if c, err := e.Count(t.Context(), parked.Filter{}); err != nil || c != n {
			t.Fatalf("%d rows after %d workers parked the same %d messages, %v", c, workers, n, err)
		}
		e.checkGroups(t)
	})
}

// noise returns n random bytes.
func noise(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return string(b)
}
