package settle

import "github.com/ThreeDotsLabs/watermill/message"

// MetadataCarrier lets an OpenTelemetry propagator (a
// propagation.TextMapCarrier) read and write a message's metadata, so trace
// context travels with the message: through a broker, and through the
// outbox table and its relay.
type MetadataCarrier message.Metadata

// Get returns the value of key, or "".
func (c MetadataCarrier) Get(key string) string { return c[key] }

// Set sets key to value.
func (c MetadataCarrier) Set(key, value string) { c[key] = value }

// Keys returns the metadata keys.
func (c MetadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
