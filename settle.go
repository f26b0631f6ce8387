// Package settle is the shared vocabulary of settle's packages: the outcomes a
// delivery can settle with, the metadata keys settle writes on messages, the
// Settlement record of one delivery, IsPermanent, and the OpenTelemetry
// options (Option) that the tracing middleware, the pipeline and the outbox
// all take.
//
// settle makes Watermill pipelines on at-least-once brokers produce effects
// that happen once. The work is done by its sub-packages, each usable on its
// own on any Watermill router:
//
//   - dedupe: claim/confirm/release of a stable message key, so a handler's
//     work is done once per key however often the broker delivers it;
//   - poison: the errors no retry can fix;
//   - middleware: bounded retry, poison and dead-letter parking, and tracing;
//   - outbox: the transactional outbox and settle's own relay;
//   - pipeline: the whole stack assembled in the right order;
//   - parked: the parked-message store, where every dead-lettered or
//     poisoned message is recorded before its ack, grouped by cause, and
//     replayed once through the outbox;
//   - console: a web page over the parked messages, the outbox and the
//     claims in flight;
//   - sqlitepubsub: watermill-sql's own Publisher and Subscriber on SQLite.
//
// The outbox is not Watermill's SQL forwarder. That forwarder relays from an
// offset bookmark, and under concurrent MariaDB writers it moved past rows
// committed after a higher offset had been read: those messages were never
// sent. It also polls, so a message waited up to its poll interval. settle's
// relay keeps a forwarded mark on each row, claims unmarked committed rows
// with FOR UPDATE SKIP LOCKED, and wakes on commit (PostgreSQL
// LISTEN/NOTIFY, or in process), polling only as a fallback. One set of
// statements runs on database/sql and on pgx through package sqldb; package
// sqlitepubsub adds the SQLite schema and offsets adapters that let
// watermill-sql itself run on SQLite (only that package imports
// watermill-sql).
//
// See docs/settlement.md for the outcomes and the order of the middleware,
// and docs/outbox.md for the relay.
package settle

import (
	"github.com/settle-go/settle/internal/settlement"
)

// Outcome is how one delivery of a message ended. Every delivery ends with
// exactly one outcome; spans and metrics are keyed on it.
type Outcome string

const (
	// Done: the handler succeeded and its key was confirmed. Acked.
	Done Outcome = "done"
	// Duplicate: the key was confirmed by an earlier delivery. Acked, the
	// handler was not run.
	Duplicate Outcome = "duplicate"
	// Deferred: not settled now, and no attempt spent: another worker holds
	// a live claim on the key, the dedupe store cannot answer, or a message
	// could not be parked (its row not written, or its copy not published).
	// Nacked after a delay so it is redelivered
	// later; never acked, since that would lose the work.
	Deferred Outcome = "deferred"
	// Retry: the handler ran and failed, and attempts remain. Nacked after a
	// backoff.
	Retry Outcome = "retry"
	// DeadLettered: attempts are exhausted. The message was recorded in the
	// parked-message store and/or a copy published to the dead-letter
	// topic, then the original was acked.
	DeadLettered Outcome = "dead_lettered"
	// Poisoned: the payload cannot be decoded or the handler returned a
	// permanent error. The message was recorded in the parked-message store
	// and/or a copy published to the poison topic, then the original was
	// acked; it is never retried.
	Poisoned Outcome = "poisoned"
)

// Metadata keys settle writes. They are prefixed with "settle_" so they do not
// collide with an application's own keys.
const (
	// MetaReason is the error text that sent a copy to a dead-letter or poison
	// topic.
	MetaReason = "settle_reason"
	// MetaOutcome is the outcome recorded on a dead-letter or poison copy:
	// "dead_lettered" or "poisoned".
	MetaOutcome = "settle_outcome"
	// MetaOriginalTopic is the topic the message was consumed from.
	MetaOriginalTopic = "settle_original_topic"
	// MetaHandler is the name of the router handler that failed.
	MetaHandler = "settle_handler"
	// MetaOriginalUUID is the UUID of the original message.
	MetaOriginalUUID = "settle_original_uuid"
	// MetaAttempt is the number of attempts made so far (decimal).
	MetaAttempt = "settle_attempt"
	// MetaFirstFailure and MetaLastFailure are the times of the first and last
	// failure, RFC 3339 with nanoseconds, UTC.
	MetaFirstFailure = "settle_first_failure_at"
	MetaLastFailure  = "settle_last_failure_at"
	// MetaDeliveryCount is how many times the broker has delivered the
	// message, including this time (decimal), when the broker says so
	// (RabbitMQ quorum queues' x-delivery-count + 1, NATS JetStream's
	// NumDelivered, a Redis Streams pending entry's times-delivered). Set by
	// settle's amqpmarshal, natsjs and redissub.Subscriber, with a mark of
	// their own process: the retry middleware
	// ignores a value without it, which is what any other marshaler passes
	// on from a producer's header of that name.
	MetaDeliveryCount = "settle_delivery_count"
	// MetaRedelivered is "true" when the broker flags the delivery as a
	// redelivery. Set by broker adapters.
	MetaRedelivered = "settle_redelivered"
)

// Metadata keys of a replayed message: a dead-letter or poison copy that an
// operator published again to its original topic (the settle command's
// "dlq replay", package parked's Replay). The replayed copy gets a new UUID,
// so that attempts counted per UUID start again; the failure keys of the
// parked copy (MetaOutcome, MetaReason, MetaAttempt, MetaHandler,
// MetaOriginalTopic, MetaOriginalUUID, MetaFirstFailure, MetaLastFailure) are
// removed from it, and what is worth keeping of them moves to these keys
// (MetaHandler to MetaReplayHandler). A replay overwrites the keys of an
// earlier replay, except MetaReplayCount, which it increments.
const (
	// MetaReplayedAt is when the message was replayed, RFC 3339 with
	// nanoseconds, UTC.
	MetaReplayedAt = "settle_replayed_at"
	// MetaReplayOf is the UUID of the parked copy that was replayed, which is
	// the UUID of the message that failed.
	MetaReplayOf = "settle_replay_of"
	// MetaReplayCount is how many times the message has been replayed
	// (decimal, 1 on the first replay).
	MetaReplayCount = "settle_replay_count"
	// MetaReplayOutcome is the MetaOutcome of the replayed copy:
	// "dead_lettered" or "poisoned".
	MetaReplayOutcome = "settle_replay_outcome"
	// MetaReplayReason is the MetaReason of the replayed copy: why the
	// message failed before it was replayed.
	MetaReplayReason = "settle_replay_reason"
	// MetaReplayedBy names who asked for the replay (parked's
	// ReplayOptions.By), when someone was named.
	MetaReplayedBy = "settle_replayed_by"
	// MetaReplayHandler names the handler whose failure the copy replays
	// (the parked row's or copy's handler, without the "#2" suffixes of a
	// pipeline's competing subscriptions). Every handler consuming the
	// topic receives the copy; the dedupe middleware (and the transactional
	// handlers of package pipeline) of any other handler acks it without
	// running, as a duplicate: that handler did not fail the message, or
	// has a copy of its own. A copy without this key reaches every handler
	// as before.
	//
	// The key is read from the message, as every key is: a producer that
	// sets it on its own message makes the other handlers skip that
	// message, which it could as well not have sent; it cannot reach any
	// message but its own. A replay overwrites the key of the original.
	MetaReplayHandler = "settle_replay_handler"
)

// NoDelay, given to a delay field of a settle configuration whose zero value
// means its default (RetryConfig.RedeliveryDelay, ParkConfig.NackDelay,
// dedupe.Config.BusyDelay, ...), means no delay at all.
const NoDelay = settlement.NoDelay
