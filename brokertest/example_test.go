package brokertest_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/brokertest"
	"github.com/settle-go/settle/sqldb"
)

// The suite on a broker of your own: a test that calls Run with a setup
// building a fresh harness for each case. The kill case runs this test
// again in a child process, so setup must build the same consumer group
// there (a fixed group name).
func ExampleRun() {
	var (
		db            *sql.DB           // settle's store: sqlurl, pgx's stdlib, ...
		publisher     message.Publisher // stores each message before Publish returns
		newSubscriber func(t *testing.T) message.Subscriber
		backlog       func(ctx context.Context, topic string) (int, error)
	)
	testMyBroker := func(t *testing.T) {
		brokertest.Run(t, func(t *testing.T) brokertest.Harness {
			return brokertest.Harness{
				Publisher:     publisher,
				NewSubscriber: newSubscriber, // its own connection, one consumer group
				DB:            db,
				Dialect:       sqldb.Postgres,
				Backlog:       backlog, // waiting + delivered-unacked of the group
			}
		})
	}
	_ = testMyBroker
}
