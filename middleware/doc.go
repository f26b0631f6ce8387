// Package middleware holds settle's settlement middleware for Watermill
// routers: bounded retry that ends in a dead-letter, and (with tracing) the
// record of how each delivery settled.
//
// The retry middleware runs a failing handler again a few times in process,
// with exponential backoff and jitter, then hands the message back to the
// broker after a delay (never a hot requeue loop), and after MaxAttempts
// attempts in all returns an *ExhaustedError. The dead-letter middleware,
// outside it, turns that error into a copy on the dead-letter topic and acks
// the original, or nacks it if the copy could not be stored.
//
// The order matters. From the outside in:
//
//	poison -> dead-letter -> retry -> dedupe -> handler
//
// The poison and dead-letter middlewares are terminal: they only ever see
// what the retry middleware gave up on. Placed inside the retry middleware,
// a dead-letter would catch the first failure and nothing would be retried.
package middleware
