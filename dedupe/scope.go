package dedupe

import (
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ScopeFunc names the scope of a delivery's key: the logical handler whose
// work the key records. Two handlers that consume the same message (two
// queues bound to one exchange, or GoChannel's fan-out) do two pieces of
// work, so by default each has its own scope and each runs once; handlers
// that return the same scope share the key and its attempt count, so only
// one of them runs.
type ScopeFunc func(msg *message.Message) string

// HandlerScope is the default ScopeFunc: the name of the Watermill handler
// the message is running in (message.HandlerNameFromCtx), without a trailing
// "#N". pipeline names a handler's competing subscriptions name, name#2,
// name#3 and so on, and they are one logical handler, so they share a scope.
// Outside a router, where the context names no handler, the scope is empty
// and the key is stored as it is.
func HandlerScope(msg *message.Message) string {
	return logicalHandler(message.HandlerNameFromCtx(msg.Context()))
}

// logicalHandler returns the logical handler of a Watermill handler name:
// the name without a trailing "#N" (N a positive decimal number).
func logicalHandler(name string) string {
	i := strings.LastIndexByte(name, '#')
	if i <= 0 || i == len(name)-1 {
		return name
	}
	for _, r := range name[i+1:] {
		if r < '0' || r > '9' {
			return name
		}
	}
	return name[:i]
}

// SharedScope returns a ScopeFunc that gives every handler it is used on the
// same scope, name. Use it to make handlers share keys on purpose: for
// example two handlers that are alternative routes to one effect, of which
// exactly one should run per message. An empty name stores keys unscoped, as
// before scopes existed.
func SharedScope(name string) ScopeFunc {
	return func(*message.Message) string { return name }
}

// ScopedKey returns the key stored for key in scope. No two (scope, key)
// pairs give the same stored key:
//
//   - the key alone, when scope is empty and key holds no NUL byte (keys
//     stored before scopes existed);
//   - the scope, a NUL byte and the key, when scope is not empty and holds
//     no NUL byte (key may hold any bytes: the first NUL ends the scope);
//   - otherwise (an empty scope with a key that holds a NUL, or a scope that
//     holds one) a NUL byte, the scope's length in decimal, a colon, the
//     scope and the key. Only this form begins with a NUL byte.
//
// So SharedScope("") with key "charge\x00order-17" is not handler charge's
// key "order-17": it is stored as "\x000:charge\x00order-17".
func ScopedKey(scope, key string) string {
	switch {
	case scope == "" && strings.IndexByte(key, 0) < 0:
		return key
	case scope != "" && strings.IndexByte(scope, 0) < 0:
		return scope + "\x00" + key
	}
	return "\x00" + strconv.Itoa(len(scope)) + ":" + scope + key
}

// messageKey derives the stored key of msg: keyFn's key in scope's scope,
// validated.
// key is keyFn's own (unscoped) key.
func messageKey(msg *message.Message, keyFn KeyFunc, scope ScopeFunc) (stored, key string, err error) {
	key, err = keyFn(msg)
	if err != nil {
		return "", "", err
	}
	if err := validateKey(key); err != nil {
		return "", "", err
	}
	stored = ScopedKey(scope(msg), key)
	if err := validateKey(stored); err != nil {
		return "", "", err
	}
	return stored, key, nil
}

// MessageKey returns the key under which the dedupe middleware (and
// pipeline's one-statement transactional handlers) record msg's work: keyFn's
// key (the message UUID when nil) in scope's scope (HandlerScope when nil). Use it
// to look a delivery's claim up in the store, or to claim it yourself.
func MessageKey(msg *message.Message, keyFn KeyFunc, scope ScopeFunc) (string, error) {
	if keyFn == nil {
		keyFn = messageUUID
	}
	if scope == nil {
		scope = HandlerScope
	}
	stored, _, err := messageKey(msg, keyFn, scope)
	return stored, err
}
