// Package deliverymark vouches, inside one process, for a delivery count
// that settle's AMQP marshaler or its Redis Streams subscriber read from
// the broker.
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
package deliverymark

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
)

// Meta is the metadata key of the mark.
const Meta = "settle_delivery_count_mark"

var key = func() []byte {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		panic("deliverymark: no randomness: " + err.Error())
	}
	return k
}()

// Sign returns the mark of count on the message uuid.
func Sign(uuid, count string) string {
	m := hmac.New(sha256.New, key)
	for _, f := range [...]string{uuid, count} {
		var n [8]byte
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
