// Package natscheck recognises watermill-nats' subscribers by reflection, so
// that watermill-nats stays out of the import graph of users of other
// brokers, and says what in them settle's guarantees cannot rely on.
// pipeline logs what it finds when a handler is added. A subscriber wrapped
// in another type is not seen through.
package natscheck

import (
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

const (
	natsPkg      = "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	jetstreamPkg = "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
)

// Problem describes what settle cannot rely on in sub when it is one of
// watermill-nats' subscribers used as it is; "" for any other subscriber
// (natsjs's included).
func Problem(sub message.Subscriber) string {
	switch pkg, cfg := subscriber(sub); pkg {
	case natsPkg:
		if d := field(cfg, "JetStream", "Disabled"); d.Kind() == reflect.Bool && d.Bool() {
			return "watermill-nats subscriber with JetStream disabled: core NATS neither keeps nor redelivers a message, so a nacked or unfinished delivery is lost"
		}
		return "watermill-nats' JetStream subscriber used as it is: settle cannot see whether its subscribe options hold nats.ManualAck (without it nats.go acks a delivery when the subscriber stops waiting for the router, after AckWaitTimeout or on Close, and the unfinished message is lost), and its deliveries carry no delivery count and no broker nack delay; build it with natsjs.NewSubscriber"
	case jetstreamPkg:
		return "watermill-nats' pkg/jetstream subscriber (beta): its deliveries carry no delivery count and no broker nack delay, and it panics on a message its unmarshaler refuses; use natsjs.NewSubscriber"
	}
	return ""
}

// AckWait is how long sub waits for the router to answer a delivery before
// JetStream may deliver it again: its AckWait() when it has one (natsjs), or
// a watermill-nats subscriber's AckWaitTimeout; false when sub says nothing.
func AckWait(sub message.Subscriber) (time.Duration, bool) {
	if s, ok := sub.(interface{ AckWait() time.Duration }); ok {
		return s.AckWait(), true
	}
	if pkg, cfg := subscriber(sub); pkg == natsPkg {
		if d := field(cfg, "AckWaitTimeout"); d.Kind() == reflect.Int64 {
			return time.Duration(d.Int()), true
		}
	}
	return 0, false
}

// subscriber returns the package of sub's type when it is a watermill-nats
// Subscriber, with its config field.
func subscriber(sub message.Subscriber) (string, reflect.Value) {
	v := reflect.ValueOf(sub)
	if !v.IsValid() || v.Kind() != reflect.Pointer || v.IsNil() {
		return "", reflect.Value{}
	}
	t := v.Type().Elem()
	if t.Name() != "Subscriber" || (t.PkgPath() != natsPkg && t.PkgPath() != jetstreamPkg) || v.Elem().Kind() != reflect.Struct {
		return "", reflect.Value{}
	}
	cfg := v.Elem().FieldByName("config")
	if cfg.Kind() != reflect.Struct {
		cfg = reflect.Value{}
	}
	return t.PkgPath(), cfg
}

// field follows names through nested struct fields; the zero Value when one
// is missing.
func field(v reflect.Value, names ...string) reflect.Value {
	for _, n := range names {
		if v.Kind() != reflect.Struct {
			return reflect.Value{}
		}
		v = v.FieldByName(n)
	}
	return v
}

// PublisherProblem describes what a parking middleware cannot do with pub
// when it is watermill-nats' own Publisher: it does not say how much its
// server takes in one message, so a copy that adds settle's headers to an
// original near NATS's bounds is refused and deferred; "" for any other
// publisher (natsjs.NewPublisher's included).
func PublisherProblem(pub message.Publisher) string {
	v := reflect.ValueOf(pub)
	if !v.IsValid() || v.Kind() != reflect.Pointer || v.IsNil() {
		return ""
	}
	if t := v.Type().Elem(); t.Name() != "Publisher" || t.PkgPath() != natsPkg {
		return ""
	}
	return "watermill-nats' Publisher does not say how much its NATS server takes in one message (JetStream's 64 KiB header block, max_payload): " +
		"a dead-letter or poison copy of a message near either is refused and its original deferred, for ever when the payload alone is near max_payload; build it with natsjs.NewPublisher"
}
