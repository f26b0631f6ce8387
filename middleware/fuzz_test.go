package middleware_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// Whatever a producer or a broker wrote into settle's attempt metadata, the
// retry middleware neither panics nor runs the handler more often than one
// delivery allows, and a delivery ends in success, a failure to redeliver, or
// exhaustion.
func FuzzAttemptMetadata(f *testing.F) {
	f.Add("3", "2", "2026-11-29T10:00:00Z", true, false)
	f.Add("-1", "0", "", false, true)
	f.Add("99999999999999999999", "x", "not a time", true, true)
	f.Add("", "1", "", false, false)
	f.Fuzz(func(t *testing.T, attempt, deliveryCount, firstFailure string, republish, fail bool) {
		cfg := middleware.RetryConfig{
			MaxAttempts: 3, InProcessRetries: 1, InitialInterval: time.Microsecond, MaxInterval: time.Microsecond,
			RedeliveryDelay: time.Microsecond,
		}
		if republish {
			cfg.Republish, cfg.RepublishKey = discard{}, []byte("0123456789abcdef")
		}
		rt, err := middleware.NewRetry(cfg)
		if err != nil {
			t.Fatal(err)
		}
		runs := 0
		h := rt(func(*message.Message) ([]*message.Message, error) {
			runs++
			if fail {
				return nil, errors.New("boom")
			}
			return nil, nil
		})
		msg := message.NewMessage("m", nil)
		msg.Metadata.Set(settle.MetaAttempt, attempt)
		msg.Metadata.Set(settle.MetaDeliveryCount, deliveryCount)
		msg.Metadata.Set(settle.MetaFirstFailure, firstFailure)
		_, err = h(msg)
		if runs > 2 {
			t.Fatalf("%d runs in one delivery; at most 1+InProcessRetries", runs)
		}
		if !fail && runs > 0 && err != nil {
			t.Fatalf("a successful run returned %v", err)
		}
		var ex *middleware.ExhaustedError
		if errors.As(err, &ex) && (ex.Attempts < 0 || ex.LastFailure.Before(ex.FirstFailure)) {
			t.Fatalf("exhausted with %+v", ex)
		}
	})
}

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }
