package natsjs_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/natsjs"
	"github.com/settle-go/settle/pipeline"
)

// pipeline says, when a handler is added, what it cannot rely on in a NATS
// subscriber: watermill-nats' own used as it is (ManualAck unseen), or an
// AckWait shorter than the claim timeout. natsjs's with the defaults passes
// in silence.
func TestPipelineChecksNATSSubscriber(t *testing.T) {
	t.Parallel()
	e := setup(t)
	stock, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{URL: e.url}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stock.Close() })
	coreNATS, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{URL: e.url, JetStream: wmnats.JetStreamConfig{Disabled: true}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = coreNATS.Close() })

	for _, tc := range []struct {
		name string
		sub  message.Subscriber
		want string // in the logged error; "" for none
	}{
		{"natsjs defaults", e.subscriber(t, natsjs.Config{}), ""},
		{"natsjs short AckWait", e.subscriber(t, natsjs.Config{AckWait: 2 * time.Second}), "AckWait 2s < ClaimTimeout 30s"},
		{"stock", stock, "nats.ManualAck"},
		{"core NATS", coreNATS, "JetStream disabled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := watermill.NewCaptureLogger()
			r, err := message.NewRouter(message.RouterConfig{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			p, err := pipeline.New(r, pipeline.Config{Publisher: e.publisher(t), DisableTracing: true, Logger: log})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Handle("h", e.topic, tc.sub, func(*message.Message) error { return nil }); err != nil {
				t.Fatal(err)
			}
			var logged []string
			for _, m := range log.Captured()[watermill.ErrorLogLevel] {
				logged = append(logged, m.Err.Error())
			}
			all := strings.Join(logged, "\n")
			switch {
			case tc.want == "" && len(logged) > 0:
				t.Errorf("logged %q, want nothing", all)
			case tc.want != "" && !strings.Contains(all, tc.want):
				t.Errorf("logged %q, want an error containing %q", all, tc.want)
			}
		})
	}
}
