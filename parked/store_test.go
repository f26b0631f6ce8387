package parked_test

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"strings"
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
			"huge":            strings.Repeat("v", 1<<20),
			"bad\xff\xfekey":  "bad\xc3value\x00nul",
			"settle_reason":   "forged",
			"<script>":        "</script><script>alert(1)</script>",
			"":                "empty key",
			"emoji \U0001F600": "ok",
		}
		cases := []struct {
			name string
			msg  *message.Message
			p    func(*settle.Parked)
		}{
			{"huge", &message.Message{UUID: "u-huge", Payload: payload, Metadata: md}, nil},
			{"no uuid", &message.Message{UUID: "", Payload: []byte("no uuid"), Metadata: message.Metadata{}}, nil},
			{"markup reason", &message.Message{UUID: "u-<script>\xff", Payload: []byte{}, Metadata: message.Metadata{}}, func(p *settle.Parked) {
				p.Cause = errors.New("<script>alert('x')</script> \xff\x00 failed")
				p.Key = "key\xff\x00<b>"
				p.Handler = "h<script>"
				p.TraceID = "0123456789abcdef0123456789abcdef"
			}},
		}
		for _, c := range cases {
			p := settle.Parked{Message: c.msg, Outcome: settle.Poisoned, Cause: errBoom, Handler: "h " + c.name, Topic: "t",
				Attempts: 2, FirstFailure: time.UnixMicro(1_700_000_000_000_001), LastFailure: time.UnixMicro(1_700_000_000_500_002)}
			if c.p != nil {
				c.p(&p)
			}
			e.park(t, p)
			page, err := e.List(t.Context(), parked.Query{Filter: parked.Filter{UUID: c.msg.UUID, Handler: p.Handler}})
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
			if m.Key != p.Key || m.Outcome != settle.Poisoned || m.Attempts != 2 || m.State != parked.StateParked || m.Topic != "t" ||
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
