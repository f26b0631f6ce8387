package middleware

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/amqpcheck"
	"github.com/settle-go/settle/internal/natscheck"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/internal/settlement"
)

// ParkConfig configures the two parking middlewares, NewPoison and
// NewDeadLetter: where the messages they park go. That is a parked-message
// store (Store), a parking topic (Publisher and Topic), or both; at least
// one of them is required.
type ParkConfig struct {
	// Store records each parked message, whole (payload and metadata, not
	// bounded as a copy on a topic is), with its handler, topic, dedupe key,
	// outcome, cause, attempts, first and last failure and trace id:
	// usually a parked.Store on the application's database, where operators
	// find, group and replay failures. Optional when Publisher and Topic
	// are set; required without them. Poison and dead-letter parking may
	// share one.
	//
	// The order is: the record is written (Park returns nil only once it is
	// committed), then the copy is published when Topic is set, then the
	// original is acked. A Park that fails defers the delivery as a failed
	// publish does (see NackDelay and PendingMessages): the message is
	// nacked, not counted as an attempt, and parked again on redelivery,
	// so Park is called again for a message whose copy could not be
	// published after its record was written (a parked.Store keeps one row
	// per message and handler). Park is given the delivery's context,
	// with StoreTimeout as its deadline.
	Store settle.ParkStore
	// StoreTimeout bounds each Store.Park: a database that does not answer
	// defers the delivery within it (as a failed Park does) instead of
	// holding it and its router slot. A Park that timed out after its
	// commit is parked again on redelivery, which a parked.Store keeps as
	// one row. Defaults to 10s when zero; must be 0 or >= 10ms. pipeline
	// sets it from its Config.StoreTimeout.
	StoreTimeout time.Duration
	// Publisher publishes the parked copies. Required with Topic, and
	// without Store; Publisher and Topic are set together or not at all.
	// Poison and dead-letter parking may share one. The original is acked
	// once Publish returns nil, so Publish must return only when the broker
	// has stored the copy. On RabbitMQ use amqpsub.Publisher, which also fails
	// a copy the broker routed to no queue (amqpsub.ErrUnroutable). A
	// watermill-amqp Publisher must have Publish.ConfirmDelivery (or
	// Publish.Transactional) set, and one without is refused
	// (ErrUnconfirmedPublisher); one with it is accepted, with an error
	// logged when the middleware is built: it reports a copy RabbitMQ
	// routed nowhere as published.
	Publisher message.Publisher
	// Topic receives the parked copies. Required with Publisher, and
	// without Store. Poison and dead-letter parking may share one; settle_outcome tells the two kinds apart.
	// With a watermill-amqp Publisher, a Topic RabbitMQ can never declare
	// (longer than 255 bytes, or starting with "amq.") is refused: every
	// copy would fail and its message, deferred at the head of its queue,
	// hold the messages behind it.
	Topic string
	// Initializer declares Topic (SubscribeInitialize) before every copy
	// is published, so that the broker has a queue to route the copy to:
	// RabbitMQ drops a message published to a queue that does not exist,
	// and still confirms it (only amqpsub.Publisher notices). A failed declaration is a failed park (the
	// delivery is deferred). Defaults to Publisher when it implements
	// message.SubscribeInitializer, else nil: nothing is declared and the
	// topic must exist before the first copy. For RabbitMQ pass the
	// subscriber of the handler (a watermill-amqp Subscriber or an
	// amqpsub.Subscriber), whose configuration routes Publisher's messages
	// for a topic to the queue it declares for it; pipeline does so. It is
	// required with a watermill-amqp Publisher, which declares no queue
	// (ErrNoInitializer): without it every copy sent to a queue nobody had
	// declared was dropped, confirmed, and its original acked.
	Initializer message.SubscribeInitializer
	// NackDelay is how long a message that could not be parked (its copy
	// not published, or Store.Park failed) is held before it is nacked, so that an unreachable topic does not turn
	// into a hot redelivery loop. Such a delivery is deferred: it is not an
	// attempt. Defaults to 1s when zero; settle.NoDelay nacks at once. Must
	// be >= 0 or settle.NoDelay.
	NackDelay time.Duration
	// PendingMessages bounds how many messages that could not be parked the
	// middleware remembers, so that their redelivery is parked
	// at once, without running the handler again. Defaults to 10000. Must be
	// >= 1.
	PendingMessages int
	// MaxMetadataBytes bounds the metadata of each copy (keys and values,
	// 6 bytes more per entry as an AMQP table spends them, and the UUID),
	// so that a copy is always publishable: a broker takes a
	// message's headers in one frame (RabbitMQ's frame_max, 128 KiB by
	// default), and settle's metadata, or the text form of a binary header
	// (base64), can make a copy of a message the broker accepted too big to
	// publish. settle's own values are bounded (settle_reason at 4 KiB,
	// made valid UTF-8); when the copy is still over the bound, the
	// original's metadata entries are left out, largest first, until it
	// fits, and MetaDroppedHeaders names them. The payload is never
	// changed. After three failed publishes of a message's copy (failed
	// declarations of the topic not counted), its next copy is minimal:
	// settle's metadata only, every original entry named in
	// MetaDroppedHeaders (logged at error level). The number of entries
	// is bounded too (8000): amqp091, under watermill-amqp, amqpsub and the
	// settle command, reads no table of more than 8192 entries, so a copy
	// of an original with that many, plus settle's own, could be stored by
	// RabbitMQ and never read back. Defaults to 64 KiB.
	// Must be 0 or >= 16 KiB.
	//
	// This count is settle's, not every broker's: NATS encodes headers
	// otherwise and bounds them apart (JetStream: a 64 KiB header block),
	// and headers and payload together (max_payload). A Publisher that
	// knows its broker's bounds on one message says so with a method
	// MessageLimits() (metadata, total int), in this count, and each copy
	// is bounded by them too, before it is published, so that it goes the
	// first time. The publisher natsjs.NewPublisher returns does;
	// watermill-nats' own Publisher does not, and its copies can be refused
	// and deferred. When the payload alone leaves no room for settle's
	// metadata within total, the copy goes without its payload, named in
	// MetaPayloadLeftOut, when Store holds the whole message; without Store
	// the delivery is deferred (logged), so that the payload is not lost.
	MaxMetadataBytes int
	// Logger defaults to watermill.NopLogger. Failures to park (a Park or a
	// publish that failed) are logged at most once per 5 seconds.
	Logger watermill.LoggerAdapter
}

// MetaDroppedHeaders is the metadata key under which a parked copy says
// which of the original's metadata entries it does not carry (see
// ParkConfig.MaxMetadataBytes): a JSON object
// {"count":N,"bytes":B,"names":[...]}, the names as many as fit in 2 KiB.
const MetaDroppedHeaders = park.MetaDroppedHeaders

// MetaPayloadLeftOut is the metadata key under which a parked copy says that
// it does not carry its original's payload: the publisher knows the most its
// broker takes in one message (natsjs.NewPublisher: NATS's max_payload), and
// the payload alone left no room beside it for settle's metadata. Its value
// is a JSON object {"bytes":N,"sha256":"<hex>"} naming the payload. Such a
// copy is published the first time instead of being refused on every
// delivery; it is logged at error level, the delivery's span gets a
// settle.payload_left_out event and the counter settle.park.payloads_left_out
// counts it. Only with ParkConfig.Store, which then holds the whole message:
// without one the delivery is deferred instead (logged at error level, at
// most once per 5 seconds), and the message stays on its queue. Absent when
// the copy carries the payload.
const MetaPayloadLeftOut = park.MetaPayloadLeftOut

// ErrUnconfirmedPublisher is wrapped by the error returned for a
// watermill-amqp Publisher whose configuration has neither
// Publish.ConfirmDelivery nor Publish.Transactional: it returns before
// RabbitMQ has stored a message, so a copy lost on the way would be taken as
// parked and the original acked.
var ErrUnconfirmedPublisher = errors.New("middleware: the publisher does not wait for the broker's confirmation (watermill-amqp: set Publish.ConfirmDelivery = true)")

// ErrNoInitializer is wrapped by the error returned for a watermill-amqp
// Publisher given without ParkConfig.Initializer: it declares no queue, and
// RabbitMQ drops and confirms a copy published to a queue that does not
// exist, so the original would be acked with its copy nowhere.
var ErrNoInitializer = errors.New("middleware: ParkConfig.Initializer is required with a watermill-amqp Publisher, which declares no queue (pass the handler's subscriber: a watermill-amqp or amqpsub Subscriber)")

// minMetadata is the least ParkConfig.MaxMetadataBytes: room for settle's
// own bounded values.
const minMetadata = 16 << 10

func (c *ParkConfig) setDefaults() {
	if c.Initializer == nil {
		c.Initializer, _ = c.Publisher.(message.SubscribeInitializer)
	}
	c.NackDelay = settlement.Delay(c.NackDelay, time.Second)
	if c.PendingMessages == 0 {
		c.PendingMessages = 10000
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.MaxMetadataBytes == 0 {
		c.MaxMetadataBytes = park.DefaultMaxMetadata
	}
	if c.StoreTimeout == 0 {
		c.StoreTimeout = defaultParkStoreTimeout
	}
}

// defaultParkStoreTimeout is ParkConfig.StoreTimeout when it is zero.
const defaultParkStoreTimeout = 10 * time.Second

// validate reports the first invalid field.
func (c ParkConfig) validate() error {
	switch {
	case c.Store == nil && c.Publisher == nil && c.Topic == "":
		return errors.New("middleware: ParkConfig.Store, or ParkConfig.Publisher and ParkConfig.Topic, is required: parking needs somewhere to put a message")
	case c.Publisher == nil && c.Topic != "":
		return errors.New("middleware: ParkConfig.Publisher is required with a Topic")
	case c.Publisher == nil && c.Store == nil:
		return errors.New("middleware: ParkConfig.Publisher is required without a Store")
	case c.Publisher == nil:
		// The store alone: nothing of the topic's applies.
		return c.validateDelays()
	case amqpcheck.Unconfirmed(c.Publisher):
		return fmt.Errorf("middleware: ParkConfig.Publisher: %w", ErrUnconfirmedPublisher)
	case c.Topic == "":
		return errors.New("middleware: ParkConfig.Topic is required with a Publisher")
	case c.Initializer == nil && amqpcheck.WatermillAMQP(c.Publisher):
		return ErrNoInitializer
	case amqpcheck.WatermillAMQP(c.Publisher) && (len(c.Topic) > 255 || strings.HasPrefix(c.Topic, "amq.")):
		// RabbitMQ never declares such a queue or exchange: every copy
		// would fail, and its message, deferred at the head of its queue,
		// hold the messages behind it for good.
		return fmt.Errorf("middleware: ParkConfig.Topic %q (%d bytes): RabbitMQ refuses a name longer than 255 bytes or starting with \"amq.\"", shortName(c.Topic), len(c.Topic))
	}
	return c.validateDelays()
}

// validateDelays reports the first invalid field of those that do not
// depend on where the messages go.
func (c ParkConfig) validateDelays() error {
	switch {
	case c.NackDelay < 0 && c.NackDelay != settle.NoDelay:
		return fmt.Errorf("middleware: ParkConfig.NackDelay must be >= 0 or settle.NoDelay, got %v", c.NackDelay)
	case c.MaxMetadataBytes != 0 && c.MaxMetadataBytes < minMetadata:
		return fmt.Errorf("middleware: ParkConfig.MaxMetadataBytes must be 0 or >= %d, got %d", minMetadata, c.MaxMetadataBytes)
	case c.PendingMessages < 1:
		return fmt.Errorf("middleware: ParkConfig.PendingMessages must be >= 1, got %d", c.PendingMessages)
	case c.StoreTimeout < 10*time.Millisecond:
		return fmt.Errorf("middleware: ParkConfig.StoreTimeout must be 0 (its default) or >= 10ms, got %v", c.StoreTimeout)
	}
	return nil
}

// shortName is name for an error message: at most 64 bytes of it.
func shortName(name string) string {
	if len(name) <= 64 {
		return name
	}
	return strings.ToValidUTF8(name[:64], "") + "…"
}

// errReturnsUnseen is logged when a parking middleware is built on
// watermill-amqp's Publisher.
var errReturnsUnseen = errors.New("watermill-amqp's Publisher does not listen for basic.return, and RabbitMQ confirms a message it routed nowhere")

func (c ParkConfig) park(name string, match func(*message.Message, *settlement.Record, error) (park.Info, bool)) (message.HandlerMiddleware, error) {
	c.setDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	if c.Publisher != nil && amqpcheck.WatermillAMQP(c.Publisher) {
		c.Logger.Error(name+": parking through watermill-amqp's Publisher: a copy that RabbitMQ routes to no queue cannot be detected, "+
			"and its original would be acked; publish the copies with amqpsub.NewPublisher", errReturnsUnseen,
			watermill.LogFields{"topic": c.Topic})
	}
	if problem := natscheck.PublisherProblem(c.Publisher); problem != "" {
		c.Logger.Error(name+": parking through watermill-nats' Publisher: copies cannot be fitted to the server's bounds", errors.New(problem),
			watermill.LogFields{"topic": c.Topic})
	}
	if c.Publisher == nil {
		c.Initializer = nil // no topic to declare
	}
	return park.Middleware(park.Config{
		Store:        c.Store,
		StoreTimeout: c.StoreTimeout,
		Publisher:    c.Publisher,
		Topic:        c.Topic,
		Initializer:  c.Initializer,
		NackDelay:    c.NackDelay,
		Logger:       c.Logger,
		Name:         name,
		Match:        match,
		Pending:      c.PendingMessages,
		MaxMetadata:  c.MaxMetadataBytes,
	}), nil
}

// NewPoison returns the poison parking middleware: a message that failed
// with a permanent error (see package poison: an undecodable payload, an
// unusable dedupe key, an error marked poison.Permanent) is copied to the
// poison topic with settle_outcome "poisoned", the error as settle_reason and
// the original topic, handler and UUID, and the original is acked. It is
// never retried, and its handler is never run again for it. With
// ParkConfig.Store, the message is recorded there first (outcome poisoned,
// the error as its cause), beside the copy or instead of it.
//
// If the record cannot be written or the copy cannot be published, the
// delivery is deferred: nacked after NackDelay, not counted as an attempt,
// and parked again on redelivery without running the handler (see
// ParkConfig.PendingMessages). Nothing is acked that is not stored somewhere
// a person can find it.
//
// Place it outermost of settle's middleware after tracing; other errors pass
// through it unchanged.
func NewPoison(cfg ParkConfig) (message.HandlerMiddleware, error) {
	return cfg.park("poison", func(msg *message.Message, rec *settlement.Record, err error) (park.Info, bool) {
		if !rec.Permanent() && !settle.IsPermanent(err) {
			return park.Info{}, false
		}
		now := time.Now()
		return park.Info{Outcome: settle.Poisoned, Reason: err.Error(), Cause: err, Attempt: attemptOf(msg, rec), FirstFailure: now, LastFailure: now}, true
	})
}

// NewDeadLetter returns the dead-letter parking middleware: a message whose
// attempts are used up (an *ExhaustedError from the retry middleware inside
// it) is copied to the dead-letter topic with settle_outcome
// "dead_lettered", the last failure as settle_reason, the original topic,
// handler and UUID, the attempt count and the first and last failure times,
// and the original is acked. With ParkConfig.Store, the message is recorded
// there first (outcome dead_lettered, the last failure as its cause),
// beside the copy or instead of it.
//
// If the record cannot be written or the copy cannot be published, the
// delivery is deferred: nacked after NackDelay, not counted as an attempt,
// and parked again on redelivery without running the handler. Other errors
// pass through unchanged.
func NewDeadLetter(cfg ParkConfig) (message.HandlerMiddleware, error) {
	return cfg.park("deadletter", func(_ *message.Message, _ *settlement.Record, err error) (park.Info, bool) {
		var ex *ExhaustedError
		if !errors.As(err, &ex) {
			return park.Info{}, false
		}
		return park.Info{
			Outcome:      settle.DeadLettered,
			Reason:       ex.Err.Error(),
			Cause:        ex.Err,
			Attempt:      ex.Attempts,
			FirstFailure: ex.FirstFailure,
			LastFailure:  ex.LastFailure,
		}, true
	})
}

// attemptOf returns the attempt of the failed run: the durable count the
// settlement holds, else the one the retry middleware wrote on the message.
func attemptOf(msg *message.Message, rec *settlement.Record) int {
	if n, _, _ := rec.Attempt(); n > 0 {
		return n
	}
	n, err := strconv.Atoi(msg.Metadata.Get(settle.MetaAttempt))
	if err != nil || n < 1 {
		return 0
	}
	return n
}
