package middleware_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
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
		{middleware.RetryConfig{RedeliveryDelay: -time.Second}, "RedeliveryDelay"},
		{middleware.RetryConfig{RedeliveryDelay: -2}, "RedeliveryDelay"},
		{middleware.RetryConfig{RandomizationFactor: -0.5}, "RandomizationFactor"},
		{middleware.RetryConfig{TrackedMessages: -1}, "TrackedMessages"},
		{middleware.RetryConfig{Republish: gochannel.NewGoChannel(gochannel.Config{}, nil)}, "RepublishKey"},
		{middleware.RetryConfig{Republish: gochannel.NewGoChannel(gochannel.Config{}, nil), RepublishKey: []byte("short")}, "RepublishKey"},
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

func TestParkingRefusesBadConfig(t *testing.T) {
	t.Parallel()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	cases := []struct {
		cfg   middleware.ParkConfig
		field string
	}{
		{middleware.ParkConfig{Topic: "dead"}, "Publisher"},
		{middleware.ParkConfig{Publisher: pub}, "Topic"},
		{middleware.ParkConfig{Publisher: pub, Topic: "dead", NackDelay: -time.Second}, "NackDelay"},
		{middleware.ParkConfig{Publisher: pub, Topic: "dead", PendingMessages: -1}, "PendingMessages"},
	}
	for _, c := range cases {
		for name, build := range map[string]func(middleware.ParkConfig) (message.HandlerMiddleware, error){
			"NewDeadLetter": middleware.NewDeadLetter, "NewPoison": middleware.NewPoison,
		} {
			if _, err := build(c.cfg); err == nil || !strings.Contains(err.Error(), "ParkConfig."+c.field) {
				t.Errorf("%s(%+v) = %v; want an error naming ParkConfig.%s", name, c.cfg, err, c.field)
			}
		}
	}
}

// Zero is a value where the documentation says so: settle.NoDelay and
// NoJitter give no delay and no jitter, where the zero value means the
// default.
func TestZeroIsConfigurable(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts: 4, InProcessRetries: 3, InitialInterval: settle.NoDelay,
		RandomizationFactor: middleware.NoJitter, RedeliveryDelay: settle.NoDelay,
	})
	must(t, err)
	runs := 0
	h := rt(func(*message.Message) ([]*message.Message, error) { runs++; return nil, errFlaky })
	start := time.Now()
	_, err = h(message.NewMessage("m", nil))
	if runs != 4 || err == nil {
		t.Fatalf("runs = %d, err = %v; want 4 failed runs", runs, err)
	}
	if d := time.Since(start); d > 50*time.Millisecond {
		t.Fatalf("4 runs with no backoff took %v", d)
	}
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	if _, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: "d", NackDelay: settle.NoDelay}); err != nil {
		t.Fatalf("NackDelay settle.NoDelay refused: %v", err)
	}
}
