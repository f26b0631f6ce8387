// Package middleware holds settle's settlement middleware for Watermill
// routers: bounded retry, the two parking middlewares (poison and
// dead-letter), and (with tracing) the record of how each delivery settled.
//
// The retry middleware runs a failing handler again a few times in process,
// with exponential backoff and jitter, then hands the message back to the
// broker after a delay (never a hot requeue loop), and once MaxAttempts runs
// of the handler have failed returns an *ExhaustedError. An attempt is one
// run of one handler on one message: a delivery deferred by trouble in
// settle's own dependencies (a busy key, a dedupe store that cannot answer, a
// message that could not be parked) is not one.
//
// NewPoison and NewDeadLetter take one ParkConfig. The poison parking parks
// a message that failed permanently; the dead-letter parking parks a
// message out of attempts. Parking is a row in a parked-message store
// (ParkConfig.Store: a parked.Store in the application's database, which
// gets the message whole), a copy on a parking topic (Publisher and Topic),
// or both; each acks the original once the row is committed and the copy
// stored, in that order, and defers it otherwise.
// "Stored" is the broker's word: the publisher must wait for the broker's
// confirmation (a watermill-amqp Publisher without Publish.ConfirmDelivery
// is refused, ErrUnconfirmedPublisher), and the parking topic is declared
// before each copy (ParkConfig.Initializer, required with a watermill-amqp
// Publisher, ErrNoInitializer), because RabbitMQ drops, and still confirms,
// a message published to a queue that does not exist. A copy is bounded so
// that a broker that accepted the message takes its copy too
// (ParkConfig.MaxMetadataBytes; the original's entries left out are named in
// settle_dropped_headers), within the broker's own bounds on one message
// when the publisher knows them (natsjs.NewPublisher); a payload too near
// NATS's max_payload to leave room for settle's metadata goes as a copy
// without it (MetaPayloadLeftOut), logged at error level, when a
// parked-message store (ParkConfig.Store) holds the whole message; without
// one the message is deferred, never acked without its payload.
//
// The order matters. From the outside in:
//
//	tracing -> poison parking -> dead-letter parking -> retry -> dedupe -> handler
//
// The parking middlewares only ever see what the retry middleware gave up
// on. Placed inside the retry middleware, a dead-letter would catch the first
// failure and nothing would be retried. The middlewares share one settlement
// record per delivery (see package settle), created by the outermost of them,
// so none needs to know another's errors.
//
// # Assembling the stack by hand
//
// pipeline assembles the stack; a router assembled by hand behaves the same,
// from its first message on, when it follows this contract:
//
//	tracing := middleware.NewTracing(...)
//	parking := middleware.ParkConfig{Store: parkedStore} // and/or Publisher, Topic, Initializer
//	poison := middleware.NewPoison(parking)          // parking.Topic: the poison topic, if any
//	deadLetter := middleware.NewDeadLetter(parking)  // parking.Topic: the dead-letter topic, if any
//	retry := middleware.NewRetry(middleware.RetryConfig{StoreCounts: true, ...})
//	dd := dedupe.NewMiddleware(dedupe.Config{...})
//	handler.AddMiddleware(tracing, poison, deadLetter, retry, dd) // outermost first
//
// When a handler returns messages for the router to publish (no
// dedupe.Config.Publisher publishing them inside the stack), add
// router.AddPublisherDecorators(middleware.TracePublished) too: the settle
// span then ends before router.Close returns (see NewTracing).
//
// With ParkConfig.Store, each parked message is recorded there before its
// copy (if a topic is set) and before the ack: Store.Park gets the original
// message whole, the error that parked it, the handler (its scope: a
// pipeline's competing subscriptions name#2... are one handler), the topic,
// the dedupe key the dedupe middleware inside wrote on the settlement record,
// the attempts, the first and last failure and the trace id of the
// delivery's span. A Park that fails defers the delivery as a failed
// publish does; the redelivery is parked again (Park is called again, and
// the store keeps one row per message and handler).
//
// Set RetryConfig.StoreCounts exactly when the dedupe middleware runs inside
// the retry middleware: the retry middleware cannot see what runs inside it
// before a run, and StoreCounts is how it knows that the store counts the
// runs and decides whether one may start. Set RetryConfig.StoreInside
// instead where a store inside knows the key but does not count the runs (a
// pipeline transactional handler in OneStatement or Batch mode): a delivery
// the middleware's own count leaves with no attempt then goes in marked as
// having none, and is a duplicate if its key is confirmed, dead-lettered
// without a run if not.
//
// What each one records in the delivery's settlement record, and reads from
// it: a middleware reads what one outside it wrote before calling it, or what
// one inside it wrote before returning, never more.
//
//   - Tracing creates the record (the outermost settle middleware that runs
//     does, whichever it is) with the propagator and span attributes the
//     parking middlewares use for their copies, and, once the delivery has
//     returned, reads the outcome, the in-process retries and where a copy
//     went, for its spans and metrics.
//   - The retry middleware writes MaxAttempts and StoreCounts before each
//     run (and, with StoreInside, that a delivery has no attempt left),
//     the attempt number it estimates, each in-process retry, the
//     outcome retry, and whether a failure was permanent; after each run it
//     reads the attempt the store counted (or its refusal), and whether the
//     run was deferred.
//   - The dedupe middleware writes the message's key (as its key function
//     gave it), reads MaxAttempts and, for an acquired claim, writes its
//     durable attempt count (or a refusal past MaxAttempts, or for a
//     delivery marked as having no attempt left), the
//     time of the first attempt, a duplicate, or a deferral (busy key, store
//     unavailable).
//   - The parking middlewares read, after the delivery has returned, whether
//     it was deferred (nothing is parked then), whether the failure was
//     permanent (poison), the attempt number and the key; they write where
//     the copy went, or a deferral when the message could not be parked.
//
// When a piece is missing or out of its place:
//
//   - No tracing: the parking middleware outermost creates the record;
//     nothing else changes.
//   - No poison parking: a permanent error is the delivery's result, and the
//     broker redelivers it; behind the dedupe middleware each redelivery is
//     an attempt, so the message is dead-lettered once MaxAttempts are
//     spent; without it, it comes back for as long as the broker redelivers.
//   - No dead-letter parking, or one inside the retry middleware: the
//     *ExhaustedError is the delivery's result, and every redelivery is
//     refused again without a run.
//   - No retry middleware: the dedupe store still counts attempts
//     (settle.SettlementFromContext), but nothing bounds them.
//   - No dedupe middleware: leave StoreCounts unset; the attempts are
//     counted as NewRetry says. Set anyway, a failed run that no store
//     counted is logged as an error and counted from the process's memory,
//     so MaxAttempts still bounds the runs.
//   - The dedupe middleware inside the retry middleware without StoreCounts:
//     the dedupe middleware logs an error once, and both count, so a message
//     whose broker delivery count alone says its runs are used up is
//     dead-lettered without a run, whatever the store's count; with
//     StoreInside, only after its claim found the key not confirmed (a
//     confirmed key is a duplicate).
//   - StoreInside set with no store inside: a delivery with no attempt
//     left runs the handler once more; the retry middleware logs an error
//     (at most once a minute) and takes the run as the last.
//   - The dedupe middleware outside the retry middleware: the retry
//     middleware logs an error (at most once a minute); its in-process
//     retries run under the delivery's one claim, and the store counts
//     deliveries, not runs.
package middleware
