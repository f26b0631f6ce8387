package integration_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/poison"
)

// parkCampaignN is how many messages the hostile-input campaign sends per
// subscriber: modest, so that it runs in CI in well under a minute.
const parkCampaignN = 60

// hostileMsg is one message of the campaign: its kind decides what the
// handler does with it (good: succeeds; dead: always fails; poison: fails
// permanently), its index is in the payload, whatever the headers are.
type hostileMsg struct {
	idx  int
	kind string
	pub  amqp091.Publishing
}

// hostileHeaders returns up to 40 random headers of every AMQP type, names
// and strings with invalid UTF-8 among them, at most budget bytes of raw
// header data; sometimes one binary header takes most of the budget, or
// thousands of tiny ones are added.
func hostileHeaders(r *rand.Rand, budget int) amqp091.Table {
	h := amqp091.Table{}
	text := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.IntN(256))
		}
		if r.IntN(2) == 0 {
			return string(bytes.ToValidUTF8(b, []byte("?")))
		}
		return string(b) // invalid UTF-8, control characters, NUL
	}
	if r.IntN(10) == 0 {
		// Thousands of tiny headers, up to amqp091's 8,192 entries (a
		// consumer sent more loses its connection: no subscriber ever
		// hands such a message on).
		n := 1000 + r.IntN(7000)
		for i := range n {
			h[fmt.Sprintf("t%05d", i)] = int8(i)
		}
		budget -= n * 9
	} else if r.IntN(8) == 0 {
		big := budget - 4<<10
		h["x-blob-"+strconv.Itoa(r.IntN(100))] = []byte(text(big))
		budget -= big
	}
	for n := r.IntN(41); n > 0 && budget > 600; n-- {
		name := text(1 + r.IntN(40))
		var v any
		switch r.IntN(14) {
		case 0:
			v = text(r.IntN(min(budget/2, 8<<10)))
		case 1:
			v = int8(r.IntN(256) - 128)
		case 2:
			v = int16(r.IntN(1 << 16))
		case 3:
			v = r.Int32()
		case 4:
			v = r.Int64() - math.MaxInt64/2
		case 5:
			// RabbitMQ 3.10 closes the connection of a publisher that
			// sends a NaN or an infinity: no consumer ever sees one.
			v = []float64{math.SmallestNonzeroFloat64, math.MaxFloat64, -1e300, r.Float64()}[r.IntN(4)]
		case 6:
			v = r.IntN(2) == 0
		case 7:
			v = []byte(text(r.IntN(min(budget/2, 16<<10))))
		case 8:
			v = time.Unix(r.Int64N(1<<32), 0)
		case 9:
			v = amqp091.Decimal{Scale: uint8(r.IntN(10)), Value: r.Int32()}
		case 10:
			v = amqp091.Table{text(5): r.Int32(), "n": amqp091.Table{"deep": []any{text(10), nil, true}}}
		case 11:
			v = []any{text(20), r.Int64(), []byte{0, 1, 2}}
		case 12:
			v = nil
		default:
			// A producer's forgery of settle's counts: never believed.
			v = []any{int32(50), "50"}[r.IntN(2)]
			name = []string{"x-delivery-count", settle.MetaAttempt, settle.MetaDeliveryCount, settle.MetaOutcome}[r.IntN(4)]
		}
		h[name] = v
		budget -= len(name) + 600 // generous for the value's share
		if b, ok := v.([]byte); ok {
			budget -= len(b)
		}
		if s, ok := v.(string); ok {
			budget -= len(s)
		}
	}
	return h
}

// hostileCampaign builds n messages with random headers, ids and payloads
// (invalid UTF-8, empty, up to 256 KiB, two of 8 MiB), 60% good, 20% dead
// letters and 20% poison.
func hostileCampaign(r *rand.Rand, n int) []hostileMsg {
	msgs := make([]hostileMsg, n)
	for i := range msgs {
		kind := "good"
		switch x := r.IntN(10); {
		case x < 2:
			kind = "dead"
		case x < 4:
			kind = "poison"
		}
		size := []int{0, 10, 1 << 10, 64 << 10, 256 << 10}[r.IntN(5)]
		if i == 7 || i == 31 {
			size = 8 << 20
		}
		body := make([]byte, size)
		for j := range body {
			body[j] = byte(r.IntN(256))
		}
		body = append([]byte(fmt.Sprintf("%s:%d:", kind, i)), body...)
		p := amqp091.Publishing{Body: body, DeliveryMode: amqp091.Persistent, Headers: hostileHeaders(r, 100<<10)}
		switch r.IntN(4) {
		case 0: // no id at all
		case 1:
			p.MessageId = fmt.Sprintf("m-%d-\xff\xfe", i) // invalid UTF-8
		default:
			p.MessageId = fmt.Sprintf("m-%d", i)
		}
		msgs[i] = hostileMsg{idx: i, kind: kind, pub: p}
	}
	return msgs
}

// hostileIndex reads a campaign message's kind and index from its payload.
func hostileIndex(payload []byte) (string, int, bool) {
	parts := bytes.SplitN(payload, []byte(":"), 3)
	if len(parts) < 3 {
		return "", 0, false
	}
	i, err := strconv.Atoi(string(parts[1]))
	return string(parts[0]), i, err == nil
}

// The hostile-input campaign for parking, on RabbitMQ with both
// subscribers: for N messages with random header counts, types and sizes up
// to the broker's frame, invalid UTF-8 in names, values and ids, forged
// attempt headers and payloads up to 8 MiB, every good message is handled
// once, every dead letter runs MaxAttempts times and every poison message
// once, each bad one is found on its parking queue with its payload
// unchanged, and nothing is left on the source queue, within a bounded time.
// SETTLE_PARK_CAMPAIGN_SEED replays a run.
func TestParkingHostileInputCampaign(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("SETTLE_PARK_CAMPAIGN_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("seed %d (SETTLE_PARK_CAMPAIGN_SEED replays it)", seed)
	for i, kind := range parkSubscribers {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			r := rand.New(rand.NewPCG(seed, uint64(i)))
			msgs := hostileCampaign(r, parkCampaignN)
			e := newParkEnv(t)
			want := map[string]int{}
			for _, m := range msgs {
				e.publish(m.pub)
				want[m.kind]++
			}
			begin := time.Now()
			runs := make([]int, len(msgs))
			stop := e.start(kind, func(msg *message.Message) error {
				k, idx, ok := hostileIndex(msg.Payload)
				if !ok || idx >= len(msgs) {
					return poison.Permanent(errors.New("not a campaign message"))
				}
				e.mu.Lock()
				runs[idx]++
				e.mu.Unlock()
				switch k {
				case "dead":
					return fmt.Errorf("message %d fails, with \x1b[31mescapes\x1b[0m and \xff invalid UTF-8", idx)
				case "poison":
					return poison.Permanent(fmt.Errorf("message %d cannot be decoded", idx))
				}
				return nil
			})
			settled := e.waitFor(func() bool {
				e.mu.Lock()
				for _, m := range msgs {
					if runs[m.idx] == 0 {
						e.mu.Unlock()
						return false
					}
				}
				e.mu.Unlock()
				return e.parked(want["dead"], want["poison"])
			})
			took := time.Since(begin)
			if n := e.finish(stop); n != 0 {
				t.Errorf("source queue holds %d messages after the router closed, want 0", n)
			}
			if !settled {
				t.Errorf("not settled within %v", parkWait)
			}
			t.Logf("%d messages (%v) settled in %v", len(msgs), want, took.Round(time.Millisecond))
			wantRuns := map[string]int{"good": 1, "dead": 2, "poison": 1}
			e.mu.Lock()
			for _, m := range msgs {
				if runs[m.idx] != wantRuns[m.kind] {
					t.Errorf("%s message %d (%d headers, %d bytes) ran %d times, want %d",
						m.kind, m.idx, len(m.pub.Headers), len(m.pub.Body), runs[m.idx], wantRuns[m.kind])
				}
			}
			e.mu.Unlock()
			for queue, kind := range map[string]string{e.dead(): "dead", e.poison(): "poison"} {
				found := map[int]bool{}
				for _, cp := range e.drain(queue) {
					k, idx, ok := hostileIndex(cp.Payload)
					if !ok || k != kind || found[idx] {
						t.Errorf("%s: unexpected copy %q (kind %q, index %d, seen %v)", queue, cp.Payload[:min(len(cp.Payload), 20)], k, idx, found[idx])
						continue
					}
					found[idx] = true
					if !bytes.Equal(cp.Payload, msgs[idx].pub.Body) {
						t.Errorf("%s: copy of message %d has another payload", queue, idx)
					}
					if got, want := cp.Metadata.Get(settle.MetaOriginalUUID), msgs[idx].pub.MessageId; got != want || cp.UUID != want {
						t.Errorf("%s: copy of message %d: UUID %q, %s %q; want %q", queue, idx, cp.UUID, settle.MetaOriginalUUID, got, want)
					}
					if cp.Metadata.Get(settle.MetaReason) == "" {
						t.Errorf("%s: copy of message %d has no reason", queue, idx)
					}
				}
				for _, m := range msgs {
					if m.kind == kind && !found[m.idx] {
						t.Errorf("%s message %d (%d headers) not found on %s", kind, m.idx, len(m.pub.Headers), queue)
					}
				}
			}
		})
	}
}
