package dedupe_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
)

func TestDeferralDelaysConfig(t *testing.T) {
	t.Parallel()
	store := dedupe.NewMemoryStore()
	for _, c := range []struct {
		cfg   dedupe.Config
		field string
	}{
		{dedupe.Config{Store: store, BusyDelay: -time.Second}, "Config.BusyDelay"},
		{dedupe.Config{Store: store, UnavailableDelay: -time.Second}, "Config.UnavailableDelay"},
		{dedupe.Config{Store: store, UnavailableDelay: time.Minute, MaxUnavailableDelay: time.Second}, "Config.MaxUnavailableDelay"},
	} {
		if _, err := dedupe.NewMiddleware(c.cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("NewMiddleware(%+v) = %v; want an error naming %s", c.cfg, err, c.field)
		}
	}
	if _, err := dedupe.NewMiddleware(dedupe.Config{Store: store, BusyDelay: settle.NoDelay, UnavailableDelay: settle.NoDelay}); err != nil {
		t.Fatalf("settle.NoDelay refused: %v", err)
	}
}

type unreachableStore struct {
	dedupe.Store
	claims atomic.Int64
}

func (s *unreachableStore) Claim(context.Context, string, time.Duration) (dedupe.Claim, error) {
	s.claims.Add(1)
	return dedupe.Claim{}, errors.New("connection refused")
}

// While the store cannot answer, the wait before each nack doubles from
// UnavailableDelay up to MaxUnavailableDelay, and the handler never runs.
func TestUnavailableDelayGrowsToItsCap(t *testing.T) {
	t.Parallel()
	store := &unreachableStore{Store: dedupe.NewMemoryStore()}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, UnavailableDelay: 10 * time.Millisecond, MaxUnavailableDelay: 40 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h := dd(func(*message.Message) ([]*message.Message, error) { t.Error("the handler ran"); return nil, nil })
	var waits []time.Duration
	for range 5 {
		start := time.Now()
		if _, err := h(message.NewMessage("m", nil)); !errors.Is(err, dedupe.ErrUnavailable) {
			t.Fatalf("err = %v; want ErrUnavailable", err)
		}
		waits = append(waits, time.Since(start))
	}
	for i, want := range []time.Duration{10, 20, 40, 40, 40} {
		if waits[i] < want*time.Millisecond {
			t.Fatalf("waits %v; want at least [10ms 20ms 40ms 40ms 40ms]", waits)
		}
	}
	if waits[4] >= 150*time.Millisecond { // uncapped, the fifth would be 160ms
		t.Fatalf("waits %v; the fifth is past the 40ms cap", waits)
	}
}
