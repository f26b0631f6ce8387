package testenv_test

import (
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/testenv"
)

// TestAMQPLoggerCloseLeaksNoConnection opens and at once closes many
// watermill-amqp publishers and subscribers side by side, the situation in
// which watermill-amqp v3.0.2's connection goroutine most often reaches its
// select late and redials after Close (without AMQPLogger, a run like this
// one leaves several connections open on a two-core machine). With
// AMQPLogger every connection must be gone.
func TestAMQPLoggerCloseLeaksNoConnection(t *testing.T) {
	url := testenv.AMQPURL(t)
	const workers, rounds = 16, 20
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range rounds {
				var c interface{ Close() error }
				var err error
				if i%2 == 0 {
					c, err = amqp.NewPublisher(amqp.NewDurableQueueConfig(url), testenv.AMQPLogger(t, nil))
				} else {
					c, err = amqp.NewSubscriber(amqp.NewDurableQueueConfig(url), testenv.AMQPLogger(t, watermill.NopLogger{}))
				}
				if err != nil {
					t.Error(err)
					return
				}
				if err := c.Close(); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	goleak.VerifyNone(t)
}
