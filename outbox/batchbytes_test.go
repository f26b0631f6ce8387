package outbox_test

import (
	"fmt"
	"strings"
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
		n, err := e.ob.Forward(t.Context(), out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, BatchBytes: bound})
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

// A relay's configuration is checked when it is built, naming the field.
func TestRelayConfigIsValidated(t *testing.T) {
	t.Parallel()
	e := setup(t, sqliteDrv)
	for _, c := range []struct {
		cfg  outbox.RelayConfig
		want string
	}{
		{outbox.RelayConfig{BatchBytes: -1}, "RelayConfig.BatchBytes"},
		{outbox.RelayConfig{MaxAttempts: -1}, "RelayConfig.MaxAttempts"},
		{outbox.RelayConfig{RetryInterval: time.Second, MaxRetryInterval: time.Millisecond}, "RelayConfig.MaxRetryInterval"},
		{outbox.RelayConfig{BatchSize: 1001}, "RelayConfig.BatchSize"},
	} {
		if _, err := e.ob.NewRelay(e.pubsub, c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewRelay(%+v) = %v; want an error naming %s", c.cfg, err, c.want)
		}
	}
	// A RetryInterval above the default cap raises the cap with it.
	if _, err := e.ob.NewRelay(e.pubsub, outbox.RelayConfig{RetryInterval: 2 * time.Minute}); err != nil {
		t.Errorf("RetryInterval 2m: %v", err)
	}
	// Selections are bounded.
	if _, err := e.ob.Failed(t.Context(), outbox.Selection{Limit: -1}); err == nil {
		t.Error("Failed with Limit -1: no error")
	}
	if _, err := e.ob.Requeue(t.Context(), outbox.Selection{Offsets: make([]int64, 1001)}); err == nil {
		t.Error("Requeue of too many offsets: no error")
	}
}
