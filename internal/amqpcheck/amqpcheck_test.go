package amqpcheck_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/internal/amqpcheck"
	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) {
	testenv.Main(m)
}

// wrapped hides the publisher it embeds from the check.
type wrapped struct{ message.Publisher }

func TestUnconfirmed(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	publisher := func(t *testing.T, set func(*amqp.Config)) *amqp.Publisher {
		t.Helper()
		cfg := amqp.NewDurableQueueConfig(url)
		set(&cfg)
		pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = pub.Close() })
		return pub
	}
	plain := publisher(t, func(*amqp.Config) {})
	cases := []struct {
		name                     string
		pub                      message.Publisher
		watermillAMQP, unconfirm bool
	}{
		{"nil", nil, false, false},
		{"nil pointer", (*amqp.Publisher)(nil), false, false},
		{"gochannel", gochannel.NewGoChannel(gochannel.Config{}, nil), false, false},
		{"watermill-amqp without confirms", plain, true, true},
		{"ConfirmDelivery", publisher(t, func(c *amqp.Config) { c.Publish.ConfirmDelivery = true }), true, false},
		{"Transactional", publisher(t, func(c *amqp.Config) { c.Publish.Transactional = true }), true, false},
		{"wrapped", wrapped{plain}, false, false},
	}
	for _, c := range cases {
		if got := amqpcheck.WatermillAMQP(c.pub); got != c.watermillAMQP {
			t.Errorf("%s: WatermillAMQP = %v, want %v", c.name, got, c.watermillAMQP)
		}
		if got := amqpcheck.Unconfirmed(c.pub); got != c.unconfirm {
			t.Errorf("%s: Unconfirmed = %v, want %v", c.name, got, c.unconfirm)
		}
	}
}
