package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/settle-go/settle/outbox"
)

// sumOf returns the value of the int64 sum named name, 0 if absent.
func sumOf(t *testing.T, reader *sdkmetric.ManualReader, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range s.DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// review: one row the broker refuses for good, with steady good traffic
// behind it: the refused row ends set aside after exactly MaxAttempts
// attempts, every good row is published once, and settle.outbox.failed
// counts one per failed attempt of the refused row (no good row charged),
// settle.outbox.forwarded one per good row.
func TestReviewRefusedRowMetricsAndAttempts(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		const maxAttempts = 3
		b := &reviewBroker{got: map[string]int{}, refused: "refused"}
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		r := startRelayOn(t, e.metered(t, mp), b, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, RetryInterval: 30 * time.Millisecond,
			MaxRetryInterval: 60 * time.Millisecond, MaxAttempts: maxAttempts})
		e.publishTx(t, "refused", message.NewMessage("bad", []byte(`{}`)))
		good := 0
		deadline := time.Now().Add(60 * time.Second)
		for {
			rows, err := e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) == 1 {
				if rows[0].UUID != "bad" || rows[0].Attempts != maxAttempts {
					t.Fatalf("set aside: %+v; want the bad row after %d attempts", rows[0], maxAttempts)
				}
				break
			}
			if time.Now().After(deadline) {
				st, _ := e.ob.Status(t.Context())
				t.Fatalf("the bad row is not set aside: %+v", st)
			}
			e.publishTx(t, "orders", message.NewMessage(fmt.Sprintf("good-%d-%s", good, watermill.NewShortUUID()), []byte(`{}`)))
			good++
			time.Sleep(10 * time.Millisecond)
		}
		if err := r.Drain(t.Context()); err != nil {
			t.Fatal(err)
		}
		got := b.counts()
		if len(got) != good {
			t.Errorf("%d good rows published, want %d", len(got), good)
		}
		for id, n := range got {
			if n != 1 {
				t.Errorf("%s published %d times", id, n)
			}
		}
		if f := sumOf(t, reader, "settle.outbox.failed"); f != maxAttempts {
			t.Errorf("settle.outbox.failed = %d, want %d (one per failed attempt of the one bad row)", f, maxAttempts)
		}
		if f := sumOf(t, reader, "settle.outbox.forwarded"); f != int64(good) {
			t.Errorf("settle.outbox.forwarded = %d, want %d", f, good)
		}
		if st, err := e.ob.Status(t.Context()); err != nil || st.SetAside != 1 || st.Pending != 0 {
			t.Errorf("status %+v, %v; want 1 set aside, none pending", st, err)
		}
	})
}
