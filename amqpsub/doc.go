// Package amqpsub is a Watermill subscriber for RabbitMQ that hands the
// router many deliveries of one subscription at once, and a publisher that
// reports a message the broker routed to no queue.
//
// # Why
//
// watermill-amqp's subscriber hands its router one delivery at a time: it
// sends a message, waits for its ack or nack, and only then reads the next,
// whatever the channel's prefetch. A handler therefore runs as many messages
// at once as it has subscriptions, and a batch (pipeline's TxConfig.Batch,
// HandleBatchTx) can hold no more deliveries than that; pipeline's
// Config.Concurrency opens one subscription, each with its own AMQP
// channel, per delivery in flight.
//
// This subscriber reads the next delivery without waiting: up to
// Config.InFlight deliveries of one subscription are in the router at the
// same time, on one AMQP channel. A batch of sixteen then comes from one
// subscription, and the acks of a batch that commits at once leave the
// client in one frame (basic.ack with multiple set) instead of sixteen, on
// one channel instead of sixteen. The messages of one subscription are then
// handled concurrently and may finish in any order, as with competing
// subscriptions; InFlight 1 handles them one at a time.
//
// # What stays the same
//
// It takes watermill-amqp's own amqp.Config: the connection and its
// reconnection settings (Connection.Reconnect; the subscriber dials again
// by itself, so amqp091's Recovery is refused), queue and exchange names,
// topology, consume options and marshaler (use amqpmarshal's). Each
// delivery is acked only when the router acks its message, and nacked
// (requeued unless Consume.NoRequeueOnNack) when the router nacks it. A
// nack is sent at once. Acks are sent in the order the deliveries arrived,
// so that the acks of a batch that commits together go in one frame; an ack
// that covers several deliveries covers only deliveries the router acked.
// One acked behind a delivery the router has not answered yet waits for it
// 10 ms at most, and not at all once InFlight or more deliveries are
// waiting: then it is acked on its own, so that one slow message holds back
// neither the broker (until the prefetch is used up) nor the acks of the
// messages that finished (which a lost connection would deliver again).
// Close sends the acks of every message the router acked before it.
//
// When the channel or the connection is lost, or the subscriber is closed,
// the deliveries not yet acked go back to the queue and are delivered again:
// at least once, as with watermill-amqp, and settle's dedupe makes their
// effects happen once. The messages of a lost channel still in the router
// have their contexts cancelled; until their handlers return, the router
// may hold them beside InFlight deliveries of the new channel.
//
// # Using it
//
//	sub, err := amqpsub.NewSubscriber(amqpsub.Config{
//		AMQP:     amqpCfg, // e.g. amqp.NewDurableQueueConfig(url), Marshaler from amqpmarshal
//		InFlight: 16,
//	}, logger)
//
// It implements message.SubscribeInitializer, as watermill-amqp's
// Subscriber does, so the dead-letter and poison queues of a handler it
// feeds are declared through it before each copy (pipeline does this; a
// router assembled by hand passes it as middleware.ParkConfig.Initializer).
// With pipeline, give it to HandleTx or HandleBatchTx with Config.Concurrency
// 1: pipeline reads InFlight to size the batches. Consume.Qos.PrefetchCount
// should be above InFlight, so that the next deliveries are already on the
// client when the ones in flight are acked; one below InFlight (the 1 of
// watermill-amqp's configurations) or 0 is raised to 4 × InFlight.
//
// # The publisher
//
// RabbitMQ drops a message it can route to no queue (a queue that does not
// exist, an exchange with no binding for the routing key) and, with
// publisher confirms, confirms it all the same. watermill-amqp's Publisher
// does not listen for the broker's basic.return, even with
// Publish.Mandatory, so it reports such a message as published; settle
// would then ack the original of a dead-letter or poison copy that is gone.
//
// Publisher takes the same amqp.Config and publishes every message with
// the mandatory flag on a channel in confirm mode, one message at a time per
// channel: RabbitMQ sends a returned message's basic.return before its
// basic.ack on the same channel, so the return that has arrived with the
// confirmation is that message's. Publish returns nil only for a message the
// broker routed and confirmed; an error wrapping ErrUnroutable for one it
// returned (naming the exchange and routing key), ErrNotConfirmed for one it
// refused or did not confirm before the channel or the connection was lost.
// Use it for parking (pipeline.Config.Publisher, middleware.ParkConfig):
//
//	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: amqpCfg}, logger)
//
// It owns its connection, dialled again with Connection.Reconnect's backoff
// when lost (a Publish while it is down fails at once), and implements
// message.SubscribeInitializer: it declares a topic's queue, exchange and
// binding as a subscriber of its configuration would, so it can declare the
// parking topics too.
//
// A message to a topic that no queue is bound to fails, where
// watermill-amqp's Publisher drops it quietly: a handler's output to a
// pub/sub exchange that has no subscriber yet is an error (the handler is
// retried). Bind a queue first, or publish such messages with another
// publisher.
//
// # What the publisher does not guarantee
//
// A message whose Publish failed with ErrNotConfirmed may still have reached
// a queue: a retry can publish it twice (settle's parking then leaves two
// copies; the dedupe of a consumer of handler output makes its effect happen
// once). A message routed to some queues that then refuse it is nacked
// (ErrNotConfirmed). An exchange with an alternate exchange that takes the
// message routes it, so it is not returned: the copy is where the alternate
// exchange put it.
package amqpsub
