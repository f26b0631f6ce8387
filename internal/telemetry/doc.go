// Package telemetry holds what settle's spans share: the propagator used
// when the application gives none, and the cleaning of every span name,
// attribute, event and status description built from message data.
//
// Everything that comes from the wire is untrusted. A message ID, a topic
// read from an outbox row or a handler's error text may hold invalid UTF-8,
// and OTLP encodes spans as protobuf, whose string fields must be valid
// UTF-8: one bad string makes the exporter refuse the whole request, so the
// other spans of the batch are lost with it. The functions here make such a
// string valid (each run of invalid bytes becomes U+FFFD) and bound its
// length, so one message can neither drop the spans of the others nor grow
// an export without limit.
package telemetry
