// Package natsjs sets up NATS JetStream for settle: watermill-nats' JetStream
// subscriber (github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats) with the
// settings settle's guarantees need, deliveries that tell settle what
// JetStream knows of them, and the matching publisher configuration.
//
// # Using it
//
// Create the streams first, each taking its topic and the topics below it
// (pipeline's default parking topics are "<topic>.dead_letter" and
// "<topic>.poison"):
//
//	nats stream add ORDERS --subjects 'orders,orders.>' --storage file --defaults
//
// Then publish with NewPublisher and consume with NewSubscriber:
//
//	pub, err := natsjs.NewPublisher(natsjs.NewPublisherConfig(url), logger)
//	sub, err := natsjs.NewSubscriber(url, natsjs.Config{Durable: "billing"}, logger)
//	p, err := pipeline.New(router, pipeline.Config{Publisher: pub, Store: store})
//	_, err = p.Handle("bill", "orders", sub, handler)
//
// Every process that consumes a topic with the same Durable shares its
// messages; each JetStream message is settled by one of them.
//
// # The settings, and why
//
//   - nats.ManualAck: without it nats.go acks a delivery when watermill-nats'
//     callback returns, and the callback returns when the subscriber stops
//     waiting for the router (its AckWaitTimeout, Close, the end of the
//     subscription's context), not only when the router acked. A message
//     whose handler was still running is then acked, and lost if the
//     process dies before the handler ends (TestKillMidHandler: with a
//     durable queue group and AckWaitTimeout but no nats.ManualAck, a
//     consumer killed mid-handler lost its message; with natsjs, shut down
//     and then killed mid-handler, a second consumer did the work).
//   - watermill-nats waits for the router's answer without end (its
//     AckWaitTimeout). When it stops waiting it cancels the message's
//     context, which stops the dedupe middleware's claim renewals: one claim
//     timeout later the next delivery would take the claim and run the
//     handler again beside the first (measured: 5 runs of a handler that
//     always succeeded, then a dead-letter, for "attempts used up").
//   - AckExplicit and the consumer's AckWait (Config.AckWait, 30s): how soon
//     the message of a dead consumer comes back. A handler that runs longer
//     has its message delivered again while it runs, to this process or
//     another: with a dedupe store that delivery finds the key claimed, is
//     deferred, and is acked as a duplicate once the first run confirms
//     (TestHandlerOutlastsAckWait: one run); without one the handler runs
//     twice. Keep AckWait above the longest handler and at least the claim
//     timeout: pipeline logs an error when it is shorter, since a dead
//     consumer's message would come back while its claim still holds and be
//     deferred until the claim lapses.
//   - A durable consumer per topic ("<Durable>_<topic>") with the queue group
//     Durable: competing consumers, and a restart resumes from the first
//     message not acked. Subscribe creates the consumer itself: nats.go
//     deletes a consumer it created when the subscription that created it
//     ends, so the first process to shut down would delete it for all the
//     others, and the next start would replay the stream from its first
//     message.
//   - Config.MaxAckPending (4 times SubscribersCount) bounds what JetStream
//     hands out ahead of the handlers, failed messages waiting out NakDelay
//     included (with 1, one failed message held back the rest for the whole
//     delay). A delivered message waits in its subscriber's buffer with its
//     AckWait running, and no other subscription can take it meanwhile.
//   - The consumer's MaxDeliver is left unlimited: settle dead-letters after
//     RetryConfig.MaxAttempts; a MaxDeliver that ran out first would drop the
//     message silently, parked nowhere.
//   - Config.NakDelay (1s): a nack goes back with NakWithDelay (below).
//   - Publishing: JetStream on, so Publish returns when a stream has stored
//     the message and fails when none takes its subject (a parked copy that
//     was not stored defers its delivery instead of being acked); no stream
//     created on the fly (watermill-nats would name it after the topic,
//     which fails for a dotted one); no TrackMsgId, whose deduplication by
//     UUID would drop a dead-letter copy, which keeps its original's UUID, in
//     the original's stream, and report it stored.
//   - NewPublisher rather than watermill-nats' NewPublisher: its Publisher
//     tells the parking middlewares the most the server takes in one
//     message (JetStream's 64 KiB header block, the connection's
//     max_payload), so that a dead-letter or poison copy, which adds
//     settle's headers to its original's, is made to fit before it is
//     published. Through watermill-nats' Publisher a copy over either is
//     refused, deferred three times and then parked without the original's
//     headers (TestCopyHeadersFitFirstTime); and the copy of a message whose
//     payload is near max_payload was refused on every delivery, for ever
//     (through NewPublisher it goes without its payload when a
//     parked-message store holds the message, and otherwise the message
//     stays on its stream, deferred: TestNearMaxPayloadIsParkedWithoutPayload,
//     TestNearMaxPayloadWithoutStoreStaysOnItsStream; see
//     middleware.MetaPayloadLeftOut).
//
// # What settle learns from each delivery
//
// The subscriber's unmarshaler reads what watermill-nats' NATSMarshaler
// writes (never failing: a header with several values keeps its first) and
// adds, from the delivery's JetStream metadata (its reply subject, which the
// server writes):
//
//   - settle.MetaDeliveryCount: NumDelivered, 1 on the first delivery;
//   - settle.MetaRedelivered: NumDelivered > 1;
//   - the delay JetStream will hold a nack for (Config.NakDelay).
//
// The count and the delay are marked with a mark only this process can make,
// so that the retry middleware believes them from this unmarshaler only:
// headers of those names from a producer are dropped here, and ignored when
// another unmarshaler (watermill-nats' own) passes them on. A producer's
// settle_delivery_count of 50 does not dead-letter a message that never ran.
//
// # Attempts
//
// With a dedupe store (pipeline.Config.Store, or a transactional handler) the
// store counts the runs, exactly. Without one, the retry middleware counts
// by NumDelivered: each earlier delivery is taken to have used all its
// 1+InProcessRetries runs, so MaxAttempts holds across restarts and crashes.
// JetStream counts every delivery, not only runs: a delivery deferred
// (busy key, store down) or delivered again after AckWait counts too, which
// can dead-letter early; it never lets a message run more than MaxAttempts
// times.
//
// # Redelivery
//
// A failed run is retried in process first (RetryConfig.InProcessRetries,
// with backoff, as on every broker). When the message is handed back to the
// broker, the retry middleware nacks it at once instead of holding it for
// RetryConfig.RedeliveryDelay: it waits only for what JetStream's own delay
// (Config.NakDelay) leaves of that delay, which is nothing with the defaults
// (1s both). The subscription then takes the next message while JetStream
// holds the failed one; it comes back no earlier than NakDelay. A delivery
// the dedupe middleware defers (busy key, store unavailable) is nacked
// sooner by NakDelay in the same way; a transactional handler still holds
// its deferred deliveries for TxConfig.BusyDelay. Set
// RetryConfig.NoInProcessRetries to send every failure to the broker at
// once.
//
// # Deliveries in flight, and batches
//
// Each subscription of watermill-nats hands the router one delivery at a
// time; Config.SubscribersCount subscriptions per Subscribe put that many in
// flight, and Subscriber.InFlight says so to pipeline, which sizes a batch
// (TxConfig.Batch, HandleBatchTx) by it. Measured (go run ./bench -only
// nats, a 1 ms handler): SubscribersCount n put n handlers in flight, as a
// nats.go pull consumer fetching n at once did, and the pull consumer was
// no faster than watermill-nats with AckAsync (Config.AckAsync); settle
// offers no pull consumer of its own.
//
// # What it does not guarantee
//
//   - Core NATS (JetStream disabled) keeps nothing and redelivers nothing:
//     settle cannot make it at-least-once. pipeline logs an error for such a
//     subscriber, and for a watermill-nats subscriber used as it is (whose
//     ManualAck it cannot see).
//   - watermill-nats' pkg/jetstream subscriber (beta) is not supported: it
//     panics on a message its unmarshaler refuses, and its deliveries carry
//     no count.
//   - A subscription that ends (Close, router shutdown) while a delivery is
//     waiting to be handed to the router races in watermill-nats v2.1.3 (the
//     race detector reports it); the delivery is not acked, and JetStream
//     delivers it again after AckWait.
package natsjs
