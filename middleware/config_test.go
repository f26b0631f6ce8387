package middleware_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/middleware"
)

func TestNewRetryRefusesBadConfig(t *testing.T) {
	t.Parallel()
	cases := []struct {
		cfg   middleware.RetryConfig
		field string
	}{
		{middleware.RetryConfig{MaxAttempts: -1}, "MaxAttempts"},
		{middleware.RetryConfig{InProcessRetries: -2}, "InProcessRetries"},
		{middleware.RetryConfig{InProcessRetries: 2, NoInProcessRetries: true}, "NoInProcessRetries"},
		{middleware.RetryConfig{InitialInterval: -time.Second}, "InitialInterval"},
		{middleware.RetryConfig{InitialInterval: time.Second, MaxInterval: time.Millisecond}, "MaxInterval"},
		{middleware.RetryConfig{Multiplier: 0.5}, "Multiplier"},
		{middleware.RetryConfig{RandomizationFactor: 1.5}, "RandomizationFactor"},
		{middleware.RetryConfig{RedeliveryDelay: -1}, "RedeliveryDelay"},
		{middleware.RetryConfig{DeferDelay: -1}, "DeferDelay"},
		{middleware.RetryConfig{TrackedMessages: -1}, "TrackedMessages"},
	}
	for _, c := range cases {
		mw, err := middleware.NewRetry(c.cfg)
		if err == nil || mw != nil {
			t.Errorf("NewRetry(%+v) accepted a bad config", c.cfg)
			continue
		}
		if !strings.Contains(err.Error(), "RetryConfig."+c.field) {
			t.Errorf("error %q does not name RetryConfig.%s", err, c.field)
		}
	}
	if _, err := middleware.NewRetry(middleware.RetryConfig{}); err != nil {
		t.Fatalf("defaults refused: %v", err)
	}
}

func TestNewDeadLetterRefusesBadConfig(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	cases := []struct {
		cfg   middleware.DeadLetterConfig
		field string
	}{
		{middleware.DeadLetterConfig{Topic: "dead"}, "Publisher"},
		{middleware.DeadLetterConfig{Publisher: pub}, "Topic"},
		{middleware.DeadLetterConfig{Publisher: pub, Topic: "dead", NackDelay: -1}, "NackDelay"},
	}
	for _, c := range cases {
		if _, err := middleware.NewDeadLetter(c.cfg); err == nil || !strings.Contains(err.Error(), "DeadLetterConfig."+c.field) {
			t.Errorf("NewDeadLetter(%+v) = %v; want an error naming DeadLetterConfig.%s", c.cfg, err, c.field)
		}
	}
}
