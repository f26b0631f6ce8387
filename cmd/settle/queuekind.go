package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// Reading a queue without removing anything means basic.get and handing
// the message back (basic.nack with requeue). A classic queue keeps no
// count of that. A quorum queue counts every hand-back as a delivery
// (x-delivery-count), and once a message's count passes the queue's
// delivery limit (the x-delivery-limit argument, or a policy's
// delivery-limit; RabbitMQ 4 gives every quorum queue a limit of 20) the
// broker drops it or dead-letters it: listing a dead-letter queue a few
// times would empty it. So the dlq commands find out, before reading
// anything, whether the queue counts deliveries, and refuse without -force.
//
// The AMQP protocol does not say a queue's type or arguments (a passive
// declare returns the message and consumer counts only; the management API
// may not be there, and a policy is not an argument). What it does show:
// quorum queues do not support global QoS, so basic.consume on a channel
// with a global prefetch limit fails with 540 NOT_IMPLEMENTED for a quorum
// queue, before any message moves, and succeeds for a classic queue. The
// probe fills that channel's prefetch window first, with a message of a
// private queue of its own, so that a classic queue cannot deliver it
// anything either: the probe leaves every queue as it found it. Behind the
// probe, should it fail (a broker that refuses global QoS, or permissions)
// or be wrong (a broker it does not know), the session stops without
// -force at the first message that carries an integer x-delivery-count,
// which quorum queues set on every delivery, having counted one delivery of
// one message.

// queueKind is what the probe found out about a queue.
type queueKind int

const (
	queueClassic  queueKind = iota // keeps no delivery count
	queueCounts                    // counts deliveries: a quorum (or stream) queue
	queueMayCount                  // the probe could not tell
)

// errCountsDeliveries is the refusal to read a queue that counts
// deliveries without -force.
var errCountsDeliveries = errors.New("not read without -force")

// countingHelp says why reading the queue is refused or risky.
func countingHelp(queue string) string {
	return fmt.Sprintf("queue %s is a quorum queue: it counts every message this command reads and hands back as a delivery (x-delivery-count), "+
		"and with a delivery limit (x-delivery-limit or a policy's delivery-limit, which AMQP cannot show; RabbitMQ 4 sets 20 by default) "+
		"a message read that many times is dropped or dead-lettered by the broker; give dead-letter queues no delivery limit, or pass -force to read it anyway", queue)
}

// inspectQueue returns what a passive declare says of queue (ready
// messages, consumers), or an error saying that there is no such queue. It
// uses a channel of its own, since a failed passive declare closes the
// channel.
func inspectQueue(conn *amqp091.Connection, queue string) (amqp091.Queue, error) {
	ch, err := conn.Channel()
	if err != nil {
		return amqp091.Queue{}, fmt.Errorf("open channel: %w", err)
	}
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		if isNotFound(err) {
			return q, fmt.Errorf("no queue named %q", queue)
		}
		return q, fmt.Errorf("queue %q: %w", queue, err)
	}
	_ = ch.Close()
	return q, nil
}

// probeTimeout bounds the probe.
const probeTimeout = 10 * time.Second

// probeQueueKind finds out whether queue counts deliveries, without moving
// a message of it (see above). It uses a connection of its own, as the
// broker answers a consume it does not support by closing the connection.
func probeQueueKind(ctx context.Context, rawURL, queue string) (queueKind, error) {
	conn, err := dialAMQP(ctx, rawURL)
	if err != nil {
		return queueMayCount, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return queueMayCount, err
	}
	if err := ch.Qos(1, 0, true); err != nil {
		return queueMayCount, fmt.Errorf("global prefetch refused: %w", err)
	}
	// Fill the channel's one-message window with a message of our own.
	own, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		return queueMayCount, fmt.Errorf("declare a private queue: %w", err)
	}
	if err := ch.PublishWithContext(ctx, "", own.Name, false, false, amqp091.Publishing{Body: []byte("settle probe")}); err != nil {
		return queueMayCount, fmt.Errorf("publish to a private queue: %w", err)
	}
	blocker, err := ch.Consume(own.Name, "", false, true, false, false, nil)
	if err != nil {
		return queueMayCount, fmt.Errorf("consume a private queue: %w", err)
	}
	select {
	case <-blocker:
	case <-time.After(probeTimeout):
		return queueMayCount, errors.New("no delivery from a private queue")
	case <-ctx.Done():
		return queueMayCount, ctx.Err()
	}
	_, err = ch.Consume(queue, "", false, false, false, false, nil)
	var ae *amqp091.Error
	switch {
	case err == nil:
		return queueClassic, nil
	case errors.As(err, &ae) && ae.Code == amqp091.NotImplemented:
		return queueCounts, nil
	}
	return queueMayCount, err
}
