// Package poison recognises messages that no retry can fix and parks them on
// a poison topic on their first failure.
//
// A message is poison when its payload cannot be decoded (a *DecodeError,
// returned by settle's typed handlers), when its dedupe key is unusable (a
// *dedupe.KeyError), or when the handler says so by returning
// Permanent(err). Retrying such a message only burns attempts and delays the
// messages behind it; the poison middleware copies it to the poison topic,
// with the reason in the copy's metadata, and acks the original. The handler
// is never called for it again.
//
// Any error type can opt in without importing this package by having a
// Permanent() bool method that returns true.
package poison
