package main

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
)

func TestSelection(t *testing.T) {
	t.Parallel()
	charge := entry{UUID: "u1", Handler: "charge", Reason: "card declined: insufficient funds", OriginalUUID: "u1"}
	email := entry{UUID: "u2", Handler: "email", Reason: "smtp 421", OriginalUUID: "orig-2"}
	for _, tc := range []struct {
		name          string
		sel           selection
		charge, email bool
	}{
		{"all", selection{all: true}, true, true},
		{"by handler", selection{handler: "charge"}, true, false},
		{"handler is exact", selection{handler: "char"}, false, false},
		{"by reason substring", selection{reason: "declined"}, true, false},
		{"by id", selection{ids: []string{"u2"}}, false, true},
		{"by original uuid", selection{ids: []string{"orig-2"}}, false, true},
		{"several ids", selection{ids: []string{"u1", "u2"}}, true, true},
		{"filters combine with and", selection{handler: "charge", reason: "smtp"}, false, false},
		{"id and handler", selection{ids: []string{"u1", "u2"}, handler: "email"}, false, true},
	} {
		if got := tc.sel.match(charge); got != tc.charge {
			t.Errorf("%s: match(charge) = %v", tc.name, got)
		}
		if got := tc.sel.match(email); got != tc.email {
			t.Errorf("%s: match(email) = %v", tc.name, got)
		}
	}
	var ids idList
	for _, v := range []string{"a,b", " c ", ",,"} {
		_ = ids.Set(v)
	}
	if ids.String() != "a,b,c" {
		t.Errorf("idList = %q, want a,b,c", ids.String())
	}
}

// parkedDelivery is a delivery as settle's dead-letter middleware and AMQP
// marshaler publish it.
func parkedDelivery(uuid string, extra amqp091.Table) amqp091.Delivery {
	h := amqp091.Table{
		amqp.DefaultMessageUUIDHeaderKey: uuid,
		settle.MetaOutcome:               string(settle.DeadLettered),
		settle.MetaReason:                "card declined\nretry later",
		settle.MetaOriginalTopic:         "orders",
		settle.MetaHandler:               "charge",
		settle.MetaOriginalUUID:          uuid,
		settle.MetaAttempt:               "5",
		settle.MetaFirstFailure:          "2025-01-02T03:04:05.123Z",
		settle.MetaLastFailure:           "2025-01-02T03:09:05.5Z",
		"traceparent":                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"priority":                       int32(7),
		"x-death":                        []any{amqp091.Table{"count": int64(1)}},
	}
	for k, v := range extra {
		h[k] = v
	}
	return amqp091.Delivery{Headers: h, MessageId: uuid, Body: []byte(`{"order":42}`), ContentType: "application/json", DeliveryMode: amqp091.Persistent, UserId: "guest"}
}

func decodeT(t *testing.T, d amqp091.Delivery) entry {
	t.Helper()
	m, err := amqpmarshal.New(amqpmarshal.Config{})
	if err != nil {
		t.Fatal(err)
	}
	e, err := decode(m, d)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestDecode(t *testing.T) {
	t.Parallel()
	e := decodeT(t, parkedDelivery("u-1", nil))
	if e.UUID != "u-1" || e.Outcome != "dead_lettered" || e.Handler != "charge" || e.OriginalTopic != "orders" ||
		e.OriginalUUID != "u-1" || e.Attempts != 5 || e.FirstFailure != "2025-01-02T03:04:05.123Z" || e.LastFailure == "" ||
		e.Reason != "card declined\nretry later" {
		t.Errorf("decode = %+v", e)
	}
	if e.Metadata["priority"] != "7" {
		t.Errorf("typed header not decoded as amqpmarshal does: %q", e.Metadata["priority"])
	}
	if _, ok := e.Metadata[settle.MetaRedelivered]; ok {
		t.Error("the delivery's redelivered flag is shown as message metadata")
	}
	if e.Payload == nil || *e.Payload != `{"order":42}` || e.PayloadBytes != 12 {
		t.Errorf("payload = %v (%d bytes)", e.Payload, e.PayloadBytes)
	}
	bin := decodeT(t, amqp091.Delivery{MessageId: "b", Body: []byte{0xff, 0x00}})
	if bin.Payload != nil || !bytes.Equal(bin.PayloadBase64, []byte{0xff, 0}) {
		t.Errorf("binary payload: %+v", bin)
	}
}

func TestWriteTable(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 100)
	entries := []entry{
		decodeT(t, parkedDelivery("u-1", nil)),
		decodeT(t, parkedDelivery("a-much-longer-uuid", amqp091.Table{settle.MetaReason: long, settle.MetaHandler: "email"})),
		{UUID: "bare"},
	}
	var b bytes.Buffer
	if err := writeTable(&b, entries); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != 4 {
		t.Fatalf("want a header and 3 rows, got:\n%s", b.String())
	}
	// Aligned: every column starts at the same offset in every line.
	col := strings.Index(lines[0], "OUTCOME")
	for _, l := range lines[1:] {
		if l[col-2:col] != "  " || l[col] == ' ' {
			t.Errorf("OUTCOME column not aligned at %d:\n%s", col, b.String())
		}
	}
	if !strings.Contains(lines[1], "card declined retry later") {
		t.Errorf("reason not on one line: %q", lines[1])
	}
	if !strings.Contains(lines[2], strings.Repeat("x", reasonWidth-3)+"...") || strings.Contains(lines[2], long) {
		t.Errorf("long reason not truncated: %q", lines[2])
	}
	if !regexp.MustCompile(`^bare +- +- +- +- +- +- +- +-$`).MatchString(lines[3]) {
		t.Errorf("empty fields not shown as '-': %q", lines[3])
	}
}

func TestWriteDetailAndJSON(t *testing.T) {
	t.Parallel()
	e := decodeT(t, parkedDelivery("u-1", nil))
	var b bytes.Buffer
	if err := writeDetail(&b, e); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"uuid:  +u-1\n", "reason:  +card declined retry later\n", "attempts:  +5\n",
		"  traceparent: 00-0af7", "payload \\(12 bytes\\):\n\\{\"order\":42\\}\n"} {
		if !regexp.MustCompile(want).MatchString(b.String()) {
			t.Errorf("detail lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	if err := writeJSON(&b, []entry{e.listView()}); err != nil {
		t.Fatal(err)
	}
	var got []map[string]any
	if err := json.Unmarshal(b.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0]["attempts"] != 5.0 || got[0]["original_topic"] != "orders" || got[0]["handler"] != "charge" ||
		got[0]["reason"] != "card declined\nretry later" || got[0]["payload"] != nil {
		t.Errorf("list JSON = %v", got)
	}
}

func TestReplayCopy(t *testing.T) {
	t.Parallel()
	now := time.Date(2025, 2, 3, 4, 5, 6, 7, time.UTC)
	d := parkedDelivery("u-1", nil)
	e := decodeT(t, d)
	p, id := replayCopy(d, e, amqp.DefaultMessageUUIDHeaderKey, now)

	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).MatchString(id) {
		t.Errorf("new id %q is not a version 5 UUID", id)
	}
	if id == "u-1" || p.MessageId != id || p.Headers[amqp.DefaultMessageUUIDHeaderKey] != id {
		t.Errorf("new id %q, message id %q, header %v", id, p.MessageId, p.Headers[amqp.DefaultMessageUUIDHeaderKey])
	}
	for _, k := range append(failureKeys, "x-death") {
		if _, ok := p.Headers[k]; ok {
			t.Errorf("replayed copy keeps %s", k)
		}
	}
	want := map[string]any{
		settle.MetaReplayOf: "u-1", settle.MetaReplayCount: "1", settle.MetaReplayedAt: "2025-02-03T04:05:06.000000007Z",
		settle.MetaReplayOutcome: "dead_lettered", settle.MetaReplayReason: "card declined\nretry later",
		settle.MetaReplayHandler: "charge",
		"priority":               int32(7), "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	}
	for k, v := range want {
		if p.Headers[k] != v {
			t.Errorf("header %s = %#v, want %#v", k, p.Headers[k], v)
		}
	}
	if string(p.Body) != `{"order":42}` || p.ContentType != "application/json" || p.DeliveryMode != amqp091.Persistent || p.UserId != "" {
		t.Errorf("properties not kept: %+v", p)
	}
	if _, ok := d.Headers[settle.MetaReplayOf]; ok || d.Headers[settle.MetaOutcome] == nil {
		t.Error("replayCopy changed the delivery's headers")
	}

	// Deterministic: the same copy replayed again gets the same UUID, so
	// dedupe drops the second; a later replay of a replay gets a new one.
	if _, again := replayCopy(d, e, amqp.DefaultMessageUUIDHeaderKey, now.Add(time.Hour)); again != id {
		t.Errorf("second replay of the same copy: %s, want %s", again, id)
	}
	d2 := parkedDelivery(id, amqp091.Table{settle.MetaReplayCount: "1", settle.MetaReplayOf: "u-1"})
	p2, id2 := replayCopy(d2, decodeT(t, d2), amqp.DefaultMessageUUIDHeaderKey, now)
	if id2 == id || id2 == "u-1" || p2.Headers[settle.MetaReplayCount] != "2" || p2.Headers[settle.MetaReplayOf] != id {
		t.Errorf("replay of a replay: id %s, headers %v", id2, p2.Headers)
	}
	if other := replayUUID("u-2", "charge", 1); other == id {
		t.Error("different messages get the same replay UUID")
	}

	// The copy is for the handler that failed, a pipeline's "#2" suffix
	// stripped, whatever the original forged; a parked copy that names no
	// handler gives a copy for every handler, forged key dropped.
	for _, c := range []struct{ handler, want string }{{"charge#2", "charge"}, {"", ""}} {
		dh := parkedDelivery("u-3", amqp091.Table{settle.MetaHandler: c.handler, settle.MetaReplayHandler: "forged"})
		if c.handler == "" {
			delete(dh.Headers, settle.MetaHandler)
		}
		ph, idh := replayCopy(dh, decodeT(t, dh), amqp.DefaultMessageUUIDHeaderKey, now)
		got, ok := ph.Headers[settle.MetaReplayHandler]
		if (c.want == "" && ok) || (c.want != "" && got != c.want) {
			t.Errorf("handler %q: copy's %s = %v, want %q", c.handler, settle.MetaReplayHandler, got, c.want)
		}
		if idh != replayUUID("u-3", c.want, 1) {
			t.Errorf("handler %q: copy's UUID %s, want %s", c.handler, idh, replayUUID("u-3", c.want, 1))
		}
	}
}

func TestProgress(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	clock := time.Unix(0, 0)
	p := newProgress(&b, time.Second)
	p.last, p.now = clock, func() time.Time { return clock }
	for i := range 30 {
		clock = clock.Add(100 * time.Millisecond)
		p.tick("at %d", i)
	}
	if got := strings.Count(b.String(), "\n"); got != 3 {
		t.Errorf("want 3 lines in 3 s at one per second, got %d:\n%s", got, b.String())
	}
	b.Reset()
	off := newProgress(&b, 0)
	off.tick("x")
	if b.Len() != 0 {
		t.Error("interval 0 printed")
	}
}
