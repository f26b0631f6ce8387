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
	"github.com/settle-go/settle/internal/settlement"
)

// silentStore is a store behind a silent partition: every call waits until
// its context ends, unless answer is set, when Claim acquires and the
// others succeed; renew makes renewals wait again.
type silentStore struct {
	answer  atomic.Bool
	silentR atomic.Bool // renewals fall silent
	calls   atomic.Int64
}

func (s *silentStore) wait(ctx context.Context) error {
	s.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

func (s *silentStore) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	if s.answer.Load() {
		return dedupe.Claim{Key: key, Result: dedupe.Acquired, Token: "t", Attempt: 1, ExpiresAt: time.Now().Add(ttl)}, nil
	}
	return dedupe.Claim{}, s.wait(ctx)
}

func (s *silentStore) Renew(ctx context.Context, _ dedupe.Claim, _ time.Duration) error {
	if s.silentR.Load() || !s.answer.Load() {
		return s.wait(ctx)
	}
	return nil
}

func (s *silentStore) Confirm(ctx context.Context, _ dedupe.Claim) error {
	if s.answer.Load() {
		return nil
	}
	return s.wait(ctx)
}

func (s *silentStore) Release(ctx context.Context, _ dedupe.Claim) error {
	if s.answer.Load() {
		return nil
	}
	return s.wait(ctx)
}

func (s *silentStore) Prune(context.Context, time.Time) (int64, error) { return 0, nil }

func TestStoreTimeoutRefusesBadConfig(t *testing.T) {
	t.Parallel()
	store := dedupe.NewMemoryStore()
	for _, cfg := range []dedupe.Config{
		{Store: store, StoreTimeout: -time.Second},
	} {
		if _, err := dedupe.NewMiddleware(cfg); err == nil || !strings.Contains(err.Error(), "Config.StoreTimeout") {
			t.Errorf("NewMiddleware(StoreTimeout %v, ClaimTimeout %v) = %v; want an error naming Config.StoreTimeout", cfg.StoreTimeout, cfg.ClaimTimeout, err)
		}
	}
}

// A claim the store does not answer (a database behind a silent partition)
// defers the delivery within StoreTimeout, with ClaimTimeout/2 (at least
// 1s) as the default, instead of holding it until the connection dies.
func TestClaimTheStoreDoesNotAnswerIsDeferredWithinStoreTimeout(t *testing.T) {
	t.Parallel()
	explicit := dedupe.Config{ClaimTimeout: time.Second, UnavailableDelay: settle.NoDelay}
	explicit.StoreTimeout = 100 * time.Millisecond
	for _, c := range []struct {
		name string
		cfg  dedupe.Config
		want time.Duration
	}{
		{"explicit", explicit, 100 * time.Millisecond},
		{"default", dedupe.Config{ClaimTimeout: 3 * time.Second, UnavailableDelay: settle.NoDelay}, 1500 * time.Millisecond},
		{"default floor", dedupe.Config{ClaimTimeout: 400 * time.Millisecond, UnavailableDelay: settle.NoDelay}, time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := &silentStore{}
			c.cfg.Store = store
			mw, err := dedupe.NewMiddleware(c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			ran := false
			h := mw(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })
			start := time.Now()
			_, err = h(message.NewMessage("m-1", nil))
			took := time.Since(start)
			if !errors.Is(err, dedupe.ErrUnavailable) || ran {
				t.Fatalf("claim on a silent store: %v, handler ran %v; want ErrUnavailable and no run", err, ran)
			}
			if took < c.want || took > c.want+2*time.Second {
				t.Fatalf("deferred after %v; want about %v", took, c.want)
			}
		})
	}
}

// A claim that lapses because renewals went unanswered cancels the handler
// (ErrClaimLost) and defers the delivery: the store's trouble, not a spent
// attempt.
func TestClaimLostToUnansweredRenewalsDefers(t *testing.T) {
	t.Parallel()
	store := &silentStore{}
	store.answer.Store(true)
	store.silentR.Store(true)
	mw, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: 300 * time.Millisecond, StoreTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		<-msg.Context().Done()
		return nil, msg.Context().Err()
	})
	msg := message.NewMessage("m-1", nil)
	ctx, rec := settlement.New(context.Background(), nil)
	msg.SetContext(ctx)
	start := time.Now()
	_, err = h(msg)
	if !errors.Is(err, dedupe.ErrClaimLost) {
		t.Fatalf("handler whose renewals went unanswered returned %v; want ErrClaimLost", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("cancelled after %v; want about the claim timeout", took)
	}
	if !rec.Deferred() {
		t.Fatal("the delivery was not deferred: a store that could not renew spent an attempt")
	}
	if n := store.calls.Load(); n < 2 {
		t.Fatalf("%d renewals tried; want several, each bounded by StoreTimeout", n)
	}
}
