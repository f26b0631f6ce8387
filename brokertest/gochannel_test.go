package brokertest_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/brokertest"
	"github.com/settle-go/settle/internal/testenv"
)

// TestGoChannel runs the suite on Watermill's in-process GoChannel with
// settle's store on SQLite: no server needed. GoChannel gives every
// subscription every message (FanOut) and keeps nothing outside the
// process (InProcess: the kill case is skipped, and there is no backlog
// to check).
func TestGoChannel(t *testing.T) {
	brokertest.Run(t, func(t *testing.T) brokertest.Harness {
		db := testenv.SQLite(t)
		gc := gochannel.NewGoChannel(gochannel.Config{}, nil)
		t.Cleanup(func() { _ = gc.Close() })
		return brokertest.Harness{
			Publisher:     gc,
			NewSubscriber: func(*testing.T) message.Subscriber { return sharedGoChannel{gc} },
			DB:            db.DB,
			Dialect:       db.Dialect,
			FanOut:        true,
			InProcess:     true,
		}
	})
}

// sharedGoChannel is one subscriber of a GoChannel that several share:
// closing it leaves the GoChannel open (the harness closes it).
type sharedGoChannel struct{ *gochannel.GoChannel }

func (sharedGoChannel) Close() error { return nil }
