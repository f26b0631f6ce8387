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
// parked copy that could not be published) is not one.
//
// NewPoison and NewDeadLetter take one ParkConfig. The poison parking copies
// a message that failed permanently to the poison topic; the dead-letter
// parking copies a message out of attempts to the dead-letter topic; each
// acks the original once its copy is stored, and defers it otherwise.
// "Stored" is the broker's word: the publisher must wait for the broker's
// confirmation (a watermill-amqp Publisher without Publish.ConfirmDelivery
// is refused, ErrUnconfirmedPublisher), and the parking topic is declared
// before each copy (ParkConfig.Initializer, required with a watermill-amqp
// Publisher, ErrNoInitializer), because RabbitMQ drops, and still confirms,
// a message published to a queue that does not exist. A copy is bounded so
// that a broker that accepted the message takes its copy too
// (ParkConfig.MaxMetadataBytes; the original's entries left out are named in
// settle_dropped_headers).
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
package middleware
