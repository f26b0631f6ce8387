// Package replay holds what every replay of a parked message agrees on,
// whichever tool replays it (the settle command's dlq replay from a broker
// queue, package parked's Replay from the parked-message table): the UUID of
// the replayed copy, and which handler a copy is for.
package replay

import (
	"crypto/sha1"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/settlement"
)

// namespace is the UUID namespace of replayed messages' UUIDs.
var namespace = [16]byte{0x6b, 0x1e, 0x0c, 0x5d, 0x93, 0x3a, 0x4f, 0x27, 0x8e, 0x54, 0x2f, 0x61, 0x0b, 0x7a, 0xc4, 0x19}

// handlerNamespace is the UUID namespace of the replayed copies addressed
// to a handler.
var handlerNamespace = [16]byte{0x2d, 0x8f, 0x41, 0xa6, 0x07, 0xc3, 0x4b, 0x9e, 0xb1, 0x5a, 0x63, 0x0d, 0xe8, 0x72, 0x16, 0xcf}

// UUID returns the UUID of the n-th replay, for handler, of the parked
// message with UUID of: a name-based (version 5) UUID, so that replaying the
// same copy twice (a replay interrupted between the publish and the removal
// from the dead-letter queue, then run again) gives both copies the same
// UUID and the dedupe middleware runs the handler once. The handler (a
// scope, settlement.ScopeOf) is part of the name: two handlers that failed
// one message have a row each, and their copies are two messages, each for
// its handler (settle.MetaReplayHandler). A copy for no handler ("", a
// parked copy that does not say which handler failed) keeps the UUID of
// the versions before handlers were named.
func UUID(of, handler string, n int) string {
	h := sha1.New()
	if handler == "" {
		h.Write(namespace[:])
		h.Write([]byte(of + "/replay/" + strconv.Itoa(n)))
	} else {
		// Lengths first: no two (of, handler, n) spell the same name.
		h.Write(handlerNamespace[:])
		h.Write([]byte(strconv.Itoa(len(of)) + ":" + of + "/" + strconv.Itoa(n) + "/" + handler))
	}
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = (u[6] & 0x0f) | 0x50 // version 5
	u[8] = (u[8] & 0x3f) | 0x80 // RFC 4122 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// ForAnother reports whether a message of metadata md, delivered to the
// router handler named running (message.HandlerNameFromCtx), is a replayed
// copy addressed to another handler (settle.MetaReplayHandler names a
// handler other than running's scope, settlement.ScopeOf), and names that
// handler. A copy addressed to no one, or a delivery outside a router
// handler (no name to compare), is not.
func ForAnother(running string, md message.Metadata) (string, bool) {
	to := md.Get(settle.MetaReplayHandler)
	if to == "" || running == "" {
		return "", false
	}
	return to, settlement.ScopeOf(running) != to
}

// DropKeys are the metadata keys a replayed copy does not carry over from
// the message it replays: settle's failure keys (settle_attempt and the
// failure times would make the retry middleware count the old attempts
// again, and the others describe a failure the replay leaves behind; the
// outcome and the reason move to settle_replay_outcome and
// settle_replay_reason), the keys the AMQP marshaler and the broker adapters
// set on the consuming side (a republished copy is a new delivery), the
// retry middleware's attempt mark (it vouches for one republished copy
// only), the handler an earlier replay addressed (a replay sets its own),
// and the headers RabbitMQ writes itself when it dead-letters a
// message or counts a quorum queue's deliveries.
var DropKeys = []string{
	settle.MetaOutcome, settle.MetaReason, settle.MetaAttempt,
	settle.MetaHandler, settle.MetaOriginalTopic, settle.MetaOriginalUUID,
	settle.MetaFirstFailure, settle.MetaLastFailure,
	settle.MetaRedelivered, settle.MetaDeliveryCount, settle.MetaReplayHandler,
	MetaAMQPHeaderTypes, MetaAttemptMark, MetaDroppedHeaders,
	"x-death", "x-delivery-count",
	"x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
	"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason",
}

// Keys of other packages, spelled here so that a replay needs neither the
// AMQP marshaler nor the parking middleware (a test checks they agree).
const (
	MetaAMQPHeaderTypes = "settle_amqp_header_types" // amqpmarshal.MetaHeaderTypes
	MetaAttemptMark     = "settle_attempt_mark"      // middleware.MetaAttemptMark
	MetaDroppedHeaders  = "settle_dropped_headers"   // internal/park.MetaDroppedHeaders
)
