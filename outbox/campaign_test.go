package outbox_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// oddMetadata fills m's metadata with what producers send and nobody
// planned for: keys of any script, spaces and punctuation, long keys, empty
// and control-character values, many keys, and now and then headers near
// the broker's frame (frame_max 128 KiB carries all of a message's
// properties), but under it.
func oddMetadata(rng *rand.Rand, m *message.Message) {
	keys := []string{"tenant", "ключ", "键-🔑", "with space", "a.b:c/d", strings.Repeat("k", 200), "x-empty"}
	for range rng.IntN(8) {
		k := keys[rng.IntN(len(keys))] + fmt.Sprint(rng.IntN(3))
		switch rng.IntN(6) {
		case 0:
			m.Metadata.Set(k, "")
		case 4: // not UTF-8: a binary header
			m.Metadata.Set(k, "bin\xff\xfe\x00\xc3(")
		case 5: // a key that is not UTF-8
			m.Metadata.Set("key-\xff"+k, "v")
		case 1:
			m.Metadata.Set(k, "line\nbreak\ttab\x01\x7f\u0085")
		case 2:
			m.Metadata.Set(k, strings.Repeat("v", rng.IntN(10<<10)))
		default:
			m.Metadata.Set(k, "значение 値 😀")
		}
	}
	if rng.IntN(10) == 0 {
		for i := range 5 + rng.IntN(45) {
			m.Metadata.Set(fmt.Sprintf("many-%d", i), "x")
		}
	}
	if rng.IntN(12) == 0 { // near the frame, under it: 88-108 KiB of headers in all
		total := 0
		for k, v := range m.Metadata {
			total += len(k) + len(v) + 6
		}
		if target := 88<<10 + rng.IntN(20<<10); target > total {
			m.Metadata.Set("big", strings.Repeat("b", target-total))
		}
	}
}

// payloadSize is mostly small, sometimes large: 1 row in 10 between
// 256 KiB and 2 MiB (a relay batch's byte bound of 1 MiB then cuts
// batches), never past what every database takes in one statement.
func payloadSize(rng *rand.Rand) int {
	if rng.IntN(10) == 0 {
		return 256<<10 + rng.IntN(2<<20-256<<10)
	}
	return rng.IntN(4 << 10)
}

// The outbox's hostile-input campaign, on every database and both
// PostgreSQL drivers, into RabbitMQ through watermill-amqp with confirms:
// transactions of 1-3 rows with random payload sizes and odd metadata, to
// three healthy topics and, one row in ten, to a destination the broker
// refuses for good (an exchange of the wrong kind). Every good row is
// delivered exactly once, every bad one ends set aside and findable with
// Failed, nothing is pending after a bounded time, and the failure counter
// counts only the bad rows' attempts. SETTLE_OUTBOX_CAMPAIGN_ROWS is not
// read: the size is modest so that it runs in CI in a few seconds.
func TestOutboxHostileInputCampaign(t *testing.T) {
	t.Parallel()
	for _, c := range brokerCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 24))
			t.Logf("seed %d", seed)
			e := setup(t, c)
			b := newBroker(t)
			good := []string{b.topic("c1"), b.topic("c2"), b.topic("c3")}
			bad := b.refused()

			const rows = 60
			const maxAttempts = 3
			r := startRelay(t, e, b.pub, outbox.RelayConfig{
				PollInterval: 20 * time.Millisecond, RetryInterval: 20 * time.Millisecond, MaxRetryInterval: 100 * time.Millisecond,
				MaxAttempts: maxAttempts, BatchBytes: 1 << 20, BatchSize: 16,
			})
			want := map[string]int{} // good UUID -> payload size
			wantBad := map[string]bool{}
			for written := 0; written < rows; {
				n := min(1+rng.IntN(3), rows-written)
				var topic string
				msgs := make([]*message.Message, n)
				if rng.IntN(10) == 0 {
					topic = bad
				} else {
					topic = good[rng.IntN(len(good))]
				}
				for i := range msgs {
					id := fmt.Sprintf("camp-%d-%s", written+i, watermill.NewUUID())
					size := payloadSize(rng)
					if e.db.Dialect == sqldb.SQLite && size > 64<<10 {
						size /= 8 // SQLite rewrites each claimed row whole
					}
					msgs[i] = message.NewMessage(id, make([]byte, size))
					oddMetadata(rng, msgs[i])
					if topic == bad {
						wantBad[id] = true
					} else {
						want[id] = size
					}
				}
				e.publishTx(t, topic, msgs...)
				written += n
			}

			got := map[string]int{}
			deadline := time.Now().Add(60 * time.Second)
			var st outbox.Status
			for {
				for _, q := range good {
					b.take(q, got)
				}
				var err error
				if st, err = e.ob.Status(t.Context()); err != nil {
					t.Fatal(err)
				}
				if len(got) >= len(want) && st.Pending == 0 && st.SetAside == int64(len(wantBad)) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("seed %d: after 60s %d of %d good rows delivered, status %+v (%s)", seed, len(got), len(want), st, st.Explain())
				}
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(100 * time.Millisecond) // a late duplicate would be on the queue by now
			for _, q := range good {
				b.take(q, got)
			}
			for id := range want {
				if got[id] != 1 {
					t.Errorf("seed %d: good row %s delivered %d times, want once", seed, id, got[id])
				}
			}
			if len(got) != len(want) {
				t.Errorf("seed %d: %d distinct messages on the queues, want %d", seed, len(got), len(want))
			}
			failed, err := e.ob.Failed(t.Context(), outbox.Selection{Limit: 1000})
			if err != nil {
				t.Fatal(err)
			}
			var attempts int64
			for _, f := range failed {
				if !wantBad[f.UUID] || f.SetAsideAt.IsZero() || f.Topic != bad || f.Attempts < maxAttempts {
					t.Errorf("seed %d: failed row %+v; want only the refused rows, set aside after %d attempts", seed, f, maxAttempts)
				}
				attempts += int64(f.Attempts)
			}
			if len(failed) != len(wantBad) {
				t.Errorf("seed %d: %d rows findable with Failed, want the %d refused ones", seed, len(failed), len(wantBad))
			}
			if _, n := r.Counts(); n != attempts {
				t.Errorf("seed %d: the relay counted %d failures, want %d, the attempts of the refused rows", seed, n, attempts)
			}
		})
	}
}
