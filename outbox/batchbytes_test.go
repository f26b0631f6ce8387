package outbox_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/outbox"
)

// sizes records the payload bytes of each Publish call.
type sizes struct {
	message.Publisher
	mu    sync.Mutex
	calls [][]int
}

func (p *sizes) Publish(topic string, msgs ...*message.Message) error {
	call := make([]int, len(msgs))
	for i, m := range msgs {
		call[i] = len(m.Payload)
	}
	p.mu.Lock()
	p.calls = append(p.calls, call)
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

// A batch is bounded in bytes as well as rows: rows of one topic go out in
// calls that hold at most RelayConfig.BatchBytes of them, a row larger than
// that alone, and every row is forwarded.
func TestBatchBytesBoundsABatch(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		const bound = 256 << 10
		rowSizes := []int{100 << 10, 100 << 10, 100 << 10, 300 << 10, 10, 10, 200 << 10, 60 << 10, 1}
		for i, n := range rowSizes {
			e.publishTx(t, "orders", message.NewMessage(fmt.Sprintf("row-%d", i), make([]byte, n)))
		}
		out := &sizes{Publisher: e.pubsub}
		n, err := e.ob.Forward(t.Context(), e.db.DB, out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, BatchBytes: bound})
		if err != nil || n != int64(len(rowSizes)) {
			t.Fatalf("Forward = %d, %v; want %d", n, err, len(rowSizes))
		}
		out.mu.Lock()
		defer out.mu.Unlock()
		total := 0
		for _, call := range out.calls {
			sum := 0
			for _, s := range call {
				sum += s + 2 // the metadata, "{}"
			}
			total += len(call)
			if len(call) > 1 && sum > bound {
				t.Errorf("one publish carried %d rows of %d bytes in all, over BatchBytes %d: %v", len(call), sum, bound, out.calls)
			}
		}
		if total != len(rowSizes) || len(out.calls) < 4 {
			t.Errorf("calls %v: want the %d rows in at least 4 batches", out.calls, len(rowSizes))
		}
	})
}
