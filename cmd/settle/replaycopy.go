package main

import (
	"strconv"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/internal/settlement"
)

// failureKeys are the keys of a parked copy that must not reach the
// replayed message: settle_attempt and the failure times would make the
// retry middleware count the old attempts again, and the others describe a
// failure the replay is meant to leave behind. Outcome and reason move to
// settle_replay_outcome and settle_replay_reason.
var failureKeys = []string{
	settle.MetaOutcome, settle.MetaReason, settle.MetaAttempt,
	settle.MetaHandler, settle.MetaOriginalTopic, settle.MetaOriginalUUID,
	settle.MetaFirstFailure, settle.MetaLastFailure,
	// Owned by the AMQP marshaler on the consuming side; never sent, but
	// drop them should a foreign publisher have sent them.
	settle.MetaRedelivered, settle.MetaDeliveryCount, amqpmarshal.MetaHeaderTypes,
}

// brokerKeys are headers RabbitMQ writes itself (its own dead-lettering and
// quorum queues' delivery count); a republished copy starts without them.
var brokerKeys = []string{
	"x-death", "x-delivery-count",
	"x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
	"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason",
}

// replayUUID returns the UUID of the n-th replay, for handler, of the parked
// message with UUID of (internal/replay: package parked's Replay derives the
// same).
func replayUUID(of, handler string, n int) string { return replay.UUID(of, handler, n) }

// replayCopy returns the publishing that replays delivery d (decoded as e)
// and its new UUID. Headers keep their AMQP types; the body and properties
// are kept, except the message ID (the new UUID) and the user ID (the broker
// refuses one that is not the publishing connection's user).
func replayCopy(d amqp091.Delivery, e entry, uuidHeader string, now time.Time) (amqp091.Publishing, string) {
	count := 1
	if n, err := strconv.Atoi(e.Metadata[settle.MetaReplayCount]); err == nil && n >= 0 {
		count = n + 1
	}
	// The copy is for the handler that failed (the parked copy's
	// settle_handler, without a pipeline's "#2" suffix): the other handlers
	// consuming the topic ack it.
	handler := settlement.ScopeOf(e.Metadata[settle.MetaHandler])
	newID := replayUUID(e.UUID, handler, count)

	h := make(amqp091.Table, len(d.Headers)+5)
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range failureKeys {
		delete(h, k)
	}
	for _, k := range brokerKeys {
		delete(h, k)
	}
	h[uuidHeader] = newID
	h[settle.MetaReplayedAt] = now.UTC().Format(time.RFC3339Nano)
	h[settle.MetaReplayOf] = e.UUID
	h[settle.MetaReplayCount] = strconv.Itoa(count)
	h[settle.MetaReplayOutcome] = e.Outcome
	h[settle.MetaReplayReason] = e.Reason
	delete(h, settle.MetaReplayHandler)
	if handler != "" {
		h[settle.MetaReplayHandler] = handler
	}

	p := amqp091.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       newID,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
	if p.DeliveryMode == 0 {
		p.DeliveryMode = amqp091.Persistent
	}
	return p, newID
}
