package natsjs

import (
	"strconv"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/deliverymark"
)

// unmarshaler decodes a JetStream delivery and adds what the broker says of
// the delivery: its count (NumDelivered), whether it is a redelivery, and the
// delay JetStream holds a nack of it for, each marked for the retry
// middleware of this process (internal/deliverymark).
type unmarshaler struct {
	inner    wmnats.Unmarshaler // nil: decode
	nakDelay time.Duration
}

func (u unmarshaler) Unmarshal(m *nats.Msg) (*message.Message, error) {
	var msg *message.Message
	if u.inner != nil {
		var err error
		if msg, err = u.inner.Unmarshal(m); err != nil {
			return nil, err
		}
		if msg.Metadata == nil {
			msg.Metadata = make(message.Metadata)
		}
		// What a header said under the names settle writes is not the
		// broker's word.
		for k := range msg.Metadata {
			if reserved(k) {
				delete(msg.Metadata, k)
			}
		}
	} else {
		msg = decode(m)
	}
	// The metadata of a JetStream delivery is in its reply subject, which
	// the server writes; a message without it (core NATS) gets no count.
	md, err := m.Metadata()
	if err != nil {
		return msg, nil
	}
	count := strconv.FormatUint(md.NumDelivered, 10)
	msg.Metadata.Set(settle.MetaDeliveryCount, count)
	msg.Metadata.Set(deliverymark.Meta, deliverymark.Sign(msg.UUID, count))
	msg.Metadata.Set(settle.MetaRedelivered, strconv.FormatBool(md.NumDelivered > 1))
	if u.nakDelay > 0 {
		deliverymark.SetNakDelay(msg, u.nakDelay)
	}
	return msg, nil
}

// decode reads what watermill-nats' NATSMarshaler writes: the UUID header,
// every other header as metadata. Unlike NATSMarshaler it never fails: a
// header with several values keeps its first (NATSMarshaler's error would
// leave the delivery unanswered, to come back after every AckWait).
func decode(m *nats.Msg) *message.Message {
	msg := message.NewMessage(m.Header.Get(wmnats.WatermillUUIDHdr), m.Data)
	msg.Metadata = make(message.Metadata, len(m.Header)+4)
	for k, v := range m.Header {
		switch {
		case len(v) == 0, reserved(k):
			continue
		case k == wmnats.WatermillUUIDHdr, k == nats.MsgIdHdr, k == nats.ExpectedLastMsgIdHdr,
			k == nats.ExpectedStreamHdr, k == nats.ExpectedLastSubjSeqHdr, k == nats.ExpectedLastSeqHdr:
			continue
		}
		msg.Metadata[k] = v[0]
	}
	return msg
}

// reserved reports whether key is one the unmarshaler writes itself.
func reserved(key string) bool {
	return key == settle.MetaRedelivered || deliverymark.Reserved(key)
}

// marshaler is watermill-nats' NATSMarshaler without the keys that describe
// one delivery (reserved), which are not the message's to carry on.
type marshaler struct{}

func (marshaler) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	hdr := make(nats.Header, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if !reserved(k) {
			hdr.Set(k, v)
		}
	}
	hdr.Set(wmnats.WatermillUUIDHdr, msg.UUID)
	return &nats.Msg{Subject: topic, Data: msg.Payload, Header: hdr}, nil
}

// NewPublisherConfig returns watermill-nats' publisher configuration for
// settle: JetStream on, so that Publish returns once a stream has stored the
// message (and fails when no stream takes its subject); no stream created
// on the fly (create them as the package documentation shows); no
// JetStream message-id deduplication (TrackMsgId), which would drop a
// dead-letter copy sharing its original's UUID in the same stream; and the
// keys settle writes for one delivery (settle_delivery_count and its mark,
// settle_redelivered, the nack delay) left out of the headers; and a
// connection that reconnects without end (nats.go gives up after 60 tries
// by default, and every Publish fails from then on). Append to NatsOptions
// for credentials or TLS.
func NewPublisherConfig(url string) wmnats.PublisherConfig {
	return wmnats.PublisherConfig{URL: url, Marshaler: marshaler{}, NatsOptions: []nats.Option{nats.MaxReconnects(-1)}}
}
