// Package amqpcheck recognises watermill-amqp's Publisher and reads the
// settings of its configuration that settle's guarantees rely on, by
// reflection, so that watermill-amqp stays out of the import graph of users
// of other brokers. The parking middlewares and the outbox relay both use
// it. A publisher wrapped in another type is not seen through.
package amqpcheck

import (
	"reflect"

	"github.com/ThreeDotsLabs/watermill/message"
)

// pkgPath is the import path of watermill-amqp's Publisher.
const pkgPath = "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

// WatermillAMQP reports whether pub is watermill-amqp's Publisher. It
// declares no queue (only an exchange, when its configuration names one)
// and does not listen for basic.return: a message it publishes to a topic
// whose queue nobody declared is dropped by RabbitMQ, and confirmed.
func WatermillAMQP(pub message.Publisher) bool {
	v := reflect.ValueOf(pub)
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return false
	}
	t := v.Type().Elem()
	return t.Name() == "Publisher" && t.PkgPath() == pkgPath
}

// Unconfirmed reports whether pub is a watermill-amqp Publisher that does not
// wait for the broker's confirmation (neither Publish.ConfirmDelivery nor
// Publish.Transactional): its Publish returns before RabbitMQ has stored the
// message, so a message lost on the way would be taken as published.
func Unconfirmed(pub message.Publisher) bool {
	if !WatermillAMQP(pub) {
		return false
	}
	pc := reflect.ValueOf(pub).Elem().FieldByName("config").FieldByName("Publish")
	if !pc.IsValid() || pc.Kind() != reflect.Struct {
		return false
	}
	confirm, tx := pc.FieldByName("ConfirmDelivery"), pc.FieldByName("Transactional")
	if confirm.Kind() != reflect.Bool || tx.Kind() != reflect.Bool {
		return false
	}
	return !confirm.Bool() && !tx.Bool()
}
