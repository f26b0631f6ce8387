// Package deliverymark vouches, inside one process, for what settle's own
// unmarshalers and subscribers read from the broker: a delivery count
// (amqpmarshal from a quorum queue's x-delivery-count, natsjs from
// JetStream's NumDelivered, redissub from a Redis Streams pending entry's
// times-delivered), and the delay the broker itself holds a nacked delivery
// for (natsjs, whose subscriber configuration nacks with NakWithDelay).
//
// settle.MetaDeliveryCount is a metadata entry like any other: a marshaler
// that copies every header into metadata (watermill-amqp's default one,
// and those of most brokers) hands the retry middleware whatever a producer
// wrote under that name, and a producer-set 50 dead-lettered a message
// without a run. amqpmarshal, which takes the count from a quorum queue's
// x-delivery-count, and redissub, which takes it from a pending entry's
// times-delivered (XPENDING), mark it with an HMAC under a key made at random when
// the process starts and never written anywhere; the retry middleware
// believes a count only with a mark that verifies. No producer, and no
// other process, can make one.
//
// The broker's nack delay is marked the same way (SetNakDelay, NakDelay): the
// retry middleware waits less before it nacks a delivery by as much as the
// broker will wait after the nack, so a failed delivery does not hold a
// goroutine and a router slot for the whole delay. A producer's header of
// that name, unmarked, is ignored: believed, it would turn the delay into a
// hot loop.
package deliverymark

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
)

// Meta is the metadata key of the mark.
const Meta = "settle_delivery_count_mark"

// Metadata keys of the broker's nack delay (a time.Duration's text) and of
// its mark.
const (
	MetaNakDelay     = "settle_nak_delay"
	MetaNakDelayMark = "settle_nak_delay_mark"
)

// Reserved reports whether key is one of the metadata keys of this package
// or settle.MetaDeliveryCount, which a settle unmarshaler writes and never
// takes from a header.
func Reserved(key string) bool {
	switch key {
	case Meta, MetaNakDelay, MetaNakDelayMark, settle.MetaDeliveryCount:
		return true
	}
	return false
}

// nakDelayDomain separates the marks of nack delays from those of counts.
const nakDelayDomain = "nak_delay"

// SetNakDelay records on msg, marked, that the broker holds a nack of this
// delivery for d before redelivering it. msg.UUID must be final.
func SetNakDelay(msg *message.Message, d time.Duration) {
	v := d.String()
	msg.Metadata.Set(MetaNakDelay, v)
	msg.Metadata.Set(MetaNakDelayMark, sign(nakDelayDomain, msg.UUID, v))
}

// NakDelay returns how long the broker holds a nack of msg before it
// redelivers it, as a settle unmarshaler of this process recorded it; 0
// when nothing verifiable is recorded.
func NakDelay(msg *message.Message) time.Duration {
	v, mark := msg.Metadata.Get(MetaNakDelay), msg.Metadata.Get(MetaNakDelayMark)
	if v == "" || mark == "" || !hmac.Equal([]byte(mark), []byte(sign(nakDelayDomain, msg.UUID, v))) {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0
	}
	return d
}

var key = func() []byte {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		panic("deliverymark: no randomness: " + err.Error())
	}
	return k
}()

// Sign returns the mark of count on the message uuid.
func Sign(uuid, count string) string { return sign(uuid, count) }

// sign returns the HMAC of the fields, each length-prefixed, so no two
// lists of fields share a text.
func sign(fields ...string) string {
	m := hmac.New(sha256.New, key)
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(fields)))
	m.Write(n[:])
	for _, f := range fields {
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		m.Write(n[:])
		m.Write([]byte(f))
	}
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// Verify reports whether mark is this process's mark of count on uuid.
func Verify(uuid, count, mark string) bool {
	if mark == "" {
		return false
	}
	return hmac.Equal([]byte(mark), []byte(Sign(uuid, count)))
}
