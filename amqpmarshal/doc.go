// Package amqpmarshal is a marshaler for watermill-amqp (v3) that accepts
// every delivery RabbitMQ can hand it.
//
// # The problem it fixes
//
// watermill-amqp's DefaultMarshaler refuses a delivery that has any header
// whose value is not a string. Such headers are common: RabbitMQ quorum
// queues add x-delivery-count (an integer) to every redelivery, and producers
// in other languages send integers, booleans, tables, arrays, timestamps,
// byte arrays, decimals and void. The subscriber treats the refusal as a
// processing failure and nacks with requeue before any router middleware
// runs, so the message comes straight back and is refused again, without end
// (Watermill issue #184; one message with an int32 header was redelivered
// 21,874 times in 3 seconds and never reached a handler). It also leaves the
// UUID empty when the UUID header is missing, even if the AMQP message-id
// property carries one.
//
// # Unmarshal
//
// Marshaler.Unmarshal never returns an error. String headers become metadata
// unchanged. Every other header becomes metadata under its own name, as text:
//
//	bool                      "true" or "false"
//	int8 uint8 int16 uint16   decimal: "-42", "7"
//	int32 uint32 int64 (int)
//	float32 float64           shortest decimal that parses back to
//	                          the same value (strconv 'g', -1):
//	                          "1.5", "1e+21", "NaN", "+Inf", "-Inf"
//	decimal                   exact, Scale digits after the point:
//	                          {Scale 2, Value -12345} is "-123.45"
//	timestamp                 RFC 3339 in UTC, fractional seconds
//	                          only if non-zero: "2024-05-01T12:00:00Z"
//	byte array                standard base64 with padding, no prefix
//	                          (the type record below says it is bytes)
//	table                     JSON object, keys sorted
//	array                     JSON array
//	void (nil)                ""
//
// Inside tables and arrays, strings and booleans are JSON strings and
// booleans, void is null, numbers and decimals are JSON numbers in the text
// above (NaN and infinities, which JSON lacks, are the strings "NaN", "+Inf",
// "-Inf"), timestamps and byte arrays are JSON strings in the text above. No
// HTML escaping is applied. Nesting deeper than 64 levels (only possible in a
// Delivery built in-process) is rendered as null.
//
// So that no value is silently reinterpreted as a string, the original type of
// every non-string header is recorded under one metadata key, MetaHeaderTypes
// ("settle_amqp_header_types"): a JSON object from header name to type name,
// keys sorted, for example
//
//	{"x-delivery-count":"int64","x-retry":"bool"}
//
// The type names are bool, int8, uint8, int16, uint16, int32, uint32, int64,
// int, float32, float64, decimal, timestamp, bytes, table, array and void.
// Only top-level headers are recorded; the types inside a table or array are
// those of its JSON text. The key is absent when every header was a string.
// (A Go value outside the AMQP types can only appear in a Delivery built
// in-process; it is rendered with fmt.Sprint and recorded under its Go type
// name.) JSON text holds only valid UTF-8: a header name in the type record,
// or a string inside a table or array, that is not valid UTF-8 has each
// invalid byte replaced by U+FFFD there, as encoding/json does. Metadata
// keys and top-level string values are never altered.
//
// The message UUID is taken from the UUID header (by default
// "_watermill_message_uuid", the one watermill-amqp uses) when it is a
// non-empty string, otherwise from the delivery's message-id property. When
// both are missing the UUID stays empty: the message still reaches the
// router, and settle's dedupe middleware, keyed on the UUID, rejects the
// empty key with a permanent *dedupe.KeyError, which the poison parking middleware
// turns into a poisoned settlement (a copy on the poison topic, then ack)
// instead of a redelivery loop. A UUID header that is not a string is kept as
// metadata like any other non-string header.
//
// # Delivery facts for the retry middleware
//
// Unmarshal also sets two metadata keys that describe the delivery rather
// than the message:
//
//   - settle.MetaRedelivered: "true" or "false", the delivery's Redelivered
//     flag. Always set.
//   - settle.MetaDeliveryCount: the x-delivery-count header plus one, in
//     decimal ("2" on the first redelivery), i.e. how many times the broker
//     has delivered the message including this time. Set only when
//     Config.QuorumQueue is set, the delivery is flagged Redelivered and the
//     header is present with an integer value. A quorum queue writes the
//     header itself on every redelivery, over any value a producer set; on
//     a first delivery it passes on the producer's header (RabbitMQ 3.10),
//     and a classic queue never writes it at all. Anywhere else the header
//     is ordinary metadata and is not trusted as a count: a producer
//     setting it to 50 would otherwise have the message dead-lettered
//     without a run. It comes with settle_delivery_count_mark, a mark that
//     only this marshaler, in this process, makes (an HMAC under a key
//     made at random at start): the retry middleware ignores a count
//     without it, as any other marshaler would pass on from a producer.
//
// These keys and MetaHeaderTypes belong to the marshaler: headers with
// those names on an incoming delivery (left by an earlier hop) are ignored,
// and Marshal does not publish them.
//
// # Marshal
//
// Marshaler.Marshal is interchangeable with DefaultMarshaler's: the payload is
// the body, metadata entries are string headers, the UUID goes into the same
// UUID header, and delivery mode is persistent unless Config.NotPersistent.
// In addition it sets the AMQP message-id property to the UUID (when the UUID
// fits its 255-byte limit), so consumers that read message-id see it. A stock
// DefaultMarshaler consumer reads what this Marshaler publishes; this
// Unmarshal reads what the stock marshaler publishes.
//
// Metadata values are published as strings, so a header that arrived as an
// integer and is published again goes out as its text; the type record is not
// published.
//
// # Use
//
// Build one with New and put it in the watermill-amqp Config of both the
// subscriber and the publisher:
//
//	m, err := amqpmarshal.New(amqpmarshal.Config{})
//	cfg := amqp.NewDurableQueueConfig(url)
//	cfg.Marshaler = m
//
// For a quorum queue, also declare the queue as one in the subscriber's
// config (cfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}) and
// say so to the subscriber's marshaler (Config.QuorumQueue), so that the
// broker's delivery count bounds the attempts where no dedupe store counts
// them.
package amqpmarshal
