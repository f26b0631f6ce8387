// Package poison names the failures that no retry can fix.
//
// A message is poison when its payload cannot be decoded (Decode, which
// settle's typed handlers return), when its dedupe key is unusable (a
// *dedupe.KeyError), or when the handler says so by returning
// Permanent(err). Retrying such a message only burns attempts and delays the
// messages behind it: settle's retry middleware returns it at once, and the
// poison parking middleware (middleware.NewPoison) copies it to the poison
// topic, with the reason in the copy's metadata, and acks the original. The
// handler is never run again for it, even when the copy could not be
// published at first: that delivery is deferred, and its redelivery is
// parked without running the handler.
//
// Any error type can opt in without importing this package by having a
// Permanent() bool method that returns true. settle.IsPermanent reports
// whether an error, or one it wraps, is permanent.
package poison
