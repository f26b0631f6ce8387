package amqpmarshal

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/deliverymark"
)

// MetaHeaderTypes is the metadata key under which Unmarshal records the AMQP
// type of every header that was not a string: a JSON object mapping the
// header's name to its type name, keys sorted, e.g.
// {"x-delivery-count":"int64","x-retry":"bool"}. It is absent when every
// header was a string.
const MetaHeaderTypes = "settle_amqp_header_types"

// deliveryCountHeader is the header RabbitMQ quorum queues put on a message
// that has been delivered before: how many earlier deliveries there were.
// A quorum queue writes it itself on every redelivery, replacing any value a
// producer wrote; on a first delivery, and on any delivery from a classic
// queue, it is whatever the producer sent. So it is read only on a
// redelivery (the Redelivered flag, which only the broker sets) and only
// when Config.QuorumQueue says the deliveries come from a quorum queue.
const deliveryCountHeader = "x-delivery-count"

// ErrInvalidConfig is wrapped by the error New returns for a bad Config.
var ErrInvalidConfig = errors.New("amqpmarshal: invalid config")

// maxShortstr is the longest AMQP short string: a header name or the
// message-id property.
const maxShortstr = 255

// Config configures a Marshaler. The zero value is valid and matches
// watermill-amqp's DefaultMarshaler.
type Config struct {
	// NotPersistent makes Marshal publish with the transient delivery mode,
	// which RabbitMQ does not keep across a restart. Defaults to false:
	// publishings are persistent.
	NotPersistent bool

	// MessageUUIDHeaderKey is the header that carries the message UUID.
	// Defaults to "_watermill_message_uuid" (amqp.DefaultMessageUUIDHeaderKey),
	// so watermill-amqp's DefaultMarshaler on the other end reads it. Must be
	// at most 255 bytes and must not be one of the metadata keys Unmarshal
	// owns (settle.MetaRedelivered, settle.MetaDeliveryCount,
	// MetaHeaderTypes).
	MessageUUIDHeaderKey string

	// QuorumQueue says that the deliveries this marshaler unmarshals come
	// from RabbitMQ quorum queues, where the broker writes the
	// x-delivery-count header itself on every redelivery (replacing any
	// value a producer set). Only then, and only on a delivery flagged
	// Redelivered, does Unmarshal turn the header into
	// settle.MetaDeliveryCount, which the retry middleware counts attempts
	// by: a first delivery passes on the producer's header unchanged. Defaults to false: on a classic queue the header is whatever the
	// producer sent (a producer that sets it to 50 would have the message
	// dead-lettered without a run), so it is kept as ordinary metadata and
	// no delivery count is set. Set it in the subscriber's marshaler only
	// when every queue it consumes is declared with x-queue-type quorum.
	QuorumQueue bool

	// PostprocessPublishing, when set, is called on every publishing Marshal
	// builds, e.g. to set ContentType or CorrelationId. Defaults to nil.
	PostprocessPublishing func(amqp091.Publishing) amqp091.Publishing
}

func (c *Config) setDefaults() {
	if c.MessageUUIDHeaderKey == "" {
		c.MessageUUIDHeaderKey = amqp.DefaultMessageUUIDHeaderKey
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
	switch {
	case c.MessageUUIDHeaderKey == "":
		return fmt.Errorf("%w: Config.MessageUUIDHeaderKey is empty", ErrInvalidConfig)
	case len(c.MessageUUIDHeaderKey) > maxShortstr:
		return fmt.Errorf("%w: Config.MessageUUIDHeaderKey must be at most %d bytes, got %d",
			ErrInvalidConfig, maxShortstr, len(c.MessageUUIDHeaderKey))
	case reserved(c.MessageUUIDHeaderKey):
		return fmt.Errorf("%w: Config.MessageUUIDHeaderKey %q is a metadata key the marshaler sets itself",
			ErrInvalidConfig, c.MessageUUIDHeaderKey)
	}
	return nil
}

// Marshaler converts Watermill messages to AMQP publishings and AMQP
// deliveries to Watermill messages without ever refusing a delivery. It
// implements watermill-amqp's amqp.Marshaler. The zero value behaves like
// New(Config{}). A Marshaler is immutable and safe for concurrent use.
type Marshaler struct {
	notPersistent bool
	quorum        bool
	uuidHeaderKey string
	postprocess   func(amqp091.Publishing) amqp091.Publishing
}

var _ amqp.Marshaler = Marshaler{}

// New returns a Marshaler configured by cfg, or an error wrapping
// ErrInvalidConfig that names the bad field.
func New(cfg Config) (Marshaler, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return Marshaler{}, err
	}
	return Marshaler{
		notPersistent: cfg.NotPersistent,
		quorum:        cfg.QuorumQueue,
		uuidHeaderKey: cfg.MessageUUIDHeaderKey,
		postprocess:   cfg.PostprocessPublishing,
	}, nil
}

func (m Marshaler) uuidKey() string {
	if m.uuidHeaderKey == "" {
		return amqp.DefaultMessageUUIDHeaderKey
	}
	return m.uuidHeaderKey
}

// Marshal builds a publishing as watermill-amqp's DefaultMarshaler does: the
// payload as body, every metadata entry as a string header, the UUID in the
// UUID header, persistent unless configured otherwise. It also sets the AMQP
// message-id property to the UUID when the UUID fits in it (255 bytes).
// The keys Unmarshal owns (settle.MetaRedelivered, settle.MetaDeliveryCount,
// MetaHeaderTypes) describe one delivery, not the message, and are not
// published. Marshal never returns an error.
func (m Marshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	uuidKey := m.uuidKey()
	headers := make(amqp091.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if reserved(k) {
			continue
		}
		headers[k] = v
	}
	headers[uuidKey] = msg.UUID

	p := amqp091.Publishing{
		Headers: headers,
		Body:    msg.Payload,
	}
	if len(msg.UUID) <= maxShortstr {
		p.MessageId = msg.UUID
	}
	if !m.notPersistent {
		p.DeliveryMode = amqp091.Persistent
	}
	if m.postprocess != nil {
		p = m.postprocess(p)
	}
	return p, nil
}

// Unmarshal converts a delivery to a message. It never returns an error.
//
// The UUID is the UUID header when that is a non-empty string, else the
// delivery's message-id property, else empty. String headers become metadata
// as they are; any other header becomes metadata in the text form described
// in the package documentation, and its type is recorded under
// MetaHeaderTypes. settle.MetaRedelivered is always set, and
// settle.MetaDeliveryCount when Config.QuorumQueue is set and the delivery
// is a redelivery with an integer x-delivery-count header, together with
// settle_delivery_count_mark, a mark that only this process can make and
// without which the retry middleware ignores a delivery count (so that no
// other marshaler passes a producer's count on to it). Headers named like
// those keys are ignored: they were written for an earlier delivery, or by
// a producer.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	uuidKey := m.uuidKey()
	uuid, _ := d.Headers[uuidKey].(string)
	if uuid == "" {
		uuid = d.MessageId
	}

	msg := message.NewMessage(uuid, d.Body)
	msg.Metadata = make(message.Metadata, len(d.Headers)+2)
	var types map[string]string
	for k, v := range d.Headers {
		if reserved(k) {
			continue
		}
		if s, ok := v.(string); ok {
			if k != uuidKey {
				msg.Metadata[k] = s
			}
			continue
		}
		// A non-string UUID header is kept like any other header, so a
		// producer's value is not lost when the UUID falls back.
		text, typ := headerText(v)
		msg.Metadata[k] = text
		if types == nil {
			types = make(map[string]string)
		}
		types[k] = typ
	}
	if types != nil {
		msg.Metadata[MetaHeaderTypes] = jsonText(types)
	}

	msg.Metadata[settle.MetaRedelivered] = strconv.FormatBool(d.Redelivered)
	// A quorum queue writes the header on every redelivery, over whatever
	// was there; a first delivery carries the producer's headers as they
	// were sent (RabbitMQ 3.10 passes a producer's x-delivery-count on).
	if n, ok := deliveryCount(d.Headers[deliveryCountHeader]); ok && m.quorum && d.Redelivered {
		count := strconv.FormatUint(n+1, 10)
		msg.Metadata[settle.MetaDeliveryCount] = count
		msg.Metadata[deliverymark.Meta] = deliverymark.Sign(msg.UUID, count)
	}
	return msg, nil
}

// reserved reports whether key is a metadata key the marshaler owns.
func reserved(key string) bool {
	switch key {
	case settle.MetaRedelivered, settle.MetaDeliveryCount, MetaHeaderTypes, deliverymark.Meta:
		return true
	}
	return false
}

// deliveryCount reads a non-negative integer x-delivery-count header.
func deliveryCount(v any) (uint64, bool) {
	var n int64
	switch v := v.(type) {
	case int8:
		n = int64(v)
	case uint8:
		n = int64(v)
	case int16:
		n = int64(v)
	case uint16:
		n = int64(v)
	case int32:
		n = int64(v)
	case uint32:
		n = int64(v)
	case int64:
		n = v
	case int:
		n = int64(v)
	default:
		return 0, false
	}
	if n < 0 {
		return 0, false
	}
	return uint64(n), true
}
