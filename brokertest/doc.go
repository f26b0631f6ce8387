// Package brokertest is the conformance suite for the brokers settle runs
// on: any Watermill publisher and subscriber pair, with settle's stack
// (package pipeline) in front of its handler, must pass it. settle's own
// tests run it on RabbitMQ (watermill-amqp and amqpsub), NATS JetStream
// (watermill-nats), Redis Streams (watermill-redisstream), watermill-sql on
// PostgreSQL and MariaDB, and GoChannel:
//
//	func TestMyBroker(t *testing.T) {
//		brokertest.Run(t, func(t *testing.T) brokertest.Harness {
//			return brokertest.Harness{
//				Publisher:     newPublisher(t),
//				NewSubscriber: newSubscriber, // a new connection each, one consumer group
//				DB:            db,            // settle's claims and the suite's effect rows
//				Dialect:       sqldb.Postgres,
//				Backlog:       backlog,       // what the group has not acked
//			}
//		})
//	}
//
// Every case runs in parallel with the others, on topics and tables of its
// own, and judges by effects: the committed rows of the handler, its runs,
// the copies on the dead-letter and poison topics, and what the broker
// still holds for the consumer group once the case's consumers are closed.
//
//   - DuplicateSequential: one message delivered twice, one after the
//     other: one run, one effect, both deliveries acked (in a
//     transactional handler, pipeline.HandleTx, and a plain one,
//     Pipeline.Handle).
//   - DuplicateConcurrent: messages published twice, consumed by two
//     consumers on separate connections at once: one run and one effect
//     each, every copy acked (the second deferred while the first holds the
//     key, then acked as a duplicate).
//   - FailedFirstRunRedone: a first run that fails is run again: two runs,
//     one effect, no dead-letter copy.
//   - MaxAttemptsThenDeadLetter: a message that always fails runs exactly
//     MaxAttempts (3) times, then exactly one copy is on the dead-letter
//     topic, and no effect is committed.
//   - PoisonNeverRuns: an undecodable payload never reaches the handler and
//     is parked on the poison topic once.
//   - BusyKeyDeferred: a message whose key another worker holds is not run
//     and not acked, but delivered again, and done once the key is free.
//   - KillMidHandler: a consumer process is killed with SIGKILL inside its
//     handler's transaction; a second consumer gets the message from the
//     broker and does the work once.
//   - StopMidHandler: a consumer is stopped (its router closed) while its
//     handler runs, and the run then fails; a second consumer gets the
//     message from the broker and does the work once. A subscriber that
//     acks on close what it handed out loses the message here.
//   - BacklogDrained: many messages on two consumers, some failing their
//     first run, are each done once.
//
// After each case, with its consumers closed, Harness.Backlog must report
// nothing left for the consumer group: no message settled but still
// waiting or pending at the broker.
//
// # The kill case runs the test binary again
//
// KillMidHandler starts the test binary (os.Args[0]) again with -test.run
// naming the test that called Run and an environment variable that makes
// Run, in that process, call setup and consume as the case's child instead
// of running the suite. So call Run from a test (or subtest) that reaches
// it the same way when run alone, and let setup build the same consumer
// group in any process (a fixed group name: the suite's topics are its
// own). A broker that lives in the test process cannot outlive a kill:
// set Harness.InProcess and the case is skipped.
//
// # What each broker needs for the cases to hold
//
// The suite does not configure the broker; the harness does. settle's own
// harnesses (integration/brokers_test.go) set these, and each was taken
// away once to see which case fails without it:
//
//   - NATS JetStream (watermill-nats v2): nats.ManualAck() in
//     JetStream.SubscribeOptions. Without it nats.go acks a message when
//     the subscriber's callback returns, which watermill-nats lets it do on
//     Close (and at AckWaitTimeout) whether or not the handler is done:
//     StopMidHandler loses its message.
//   - NATS JetStream: a durable consumer that outlives its subscribers.
//     nats.go deletes a consumer it created itself when that subscription
//     is unsubscribed, which watermill-nats does on Close; the group's acks
//     go with it, and the next subscriber creates it again and is handed
//     the whole stream again. Create the durable consumer before
//     subscribing (JetStreamContext.AddConsumer, push, with the queue group
//     as DeliverGroup), so that nats.go binds to it: else the backlog check
//     fails ("consumer not found"). nats.AckWait is how soon a dead
//     consumer's message comes back.
//   - Redis Streams (watermill-redisstream): a ConsumerGroup, and a short
//     MaxIdleTime (with ClaimInterval below it): a dead consumer's pending
//     messages return only when a live consumer of the group claims them,
//     after MaxIdleTime, 60s by default, past KillMidHandler's wait.
//   - watermill-sql: a payload column that takes any bytes (BYTEA on
//     PostgreSQL, BLOB on MySQL and MariaDB); the default JSON column
//     refuses an undecodable payload at publish (PoisonNeverRuns cannot
//     even publish it).
package brokertest
