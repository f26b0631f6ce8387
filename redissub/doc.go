// Package redissub is what settle needs on Redis Streams: the settings of
// watermill-redisstream's subscriber under which the guarantee holds, and
// a subscriber of its own that gives each message the delivery count Redis
// keeps and hands the router many entries of one subscription at once.
//
// # watermill-redisstream's subscriber
//
// SubscriberConfig returns its configuration for a consumer group, with
// every setting chosen and its reason in the function's documentation, and
// CheckSubscriberConfig refuses one under which a message can be lost:
//
//	sub, err := redisstream.NewSubscriber(redissub.SubscriberConfig(client, "orders"), logger)
//
// With it, settle's dedupe store counts the attempts (pipeline sets this
// up): watermill-redisstream gives no delivery count. Its unmarshaler sees
// only an entry's fields, not its ID or its pending entry; its claim loop
// reads the times-delivered of each entry (XPENDING) and drops it; and a
// nack is answered in the process, by handing the same message to the
// router again at once, so Redis never hears of it and its count does not
// grow. A producer's settle_delivery_count reaches the router unchanged
// through its unmarshaler, and the retry middleware ignores it (it carries
// no mark of this process).
//
// # Subscriber
//
// Subscriber reads a consumer group with XREADGROUP COUNT and keeps up to
// InFlight entries of one subscription in the router at once, and as many
// more read ahead (watermill-redisstream's reads one and waits for its
// ack before it reads the next). Every message
// carries settle.MetaDeliveryCount, the number of times Redis has delivered
// the entry, this time included, marked as amqpmarshal marks a quorum
// queue's count so that the retry middleware believes it and nothing a
// producer wrote: 1 for an entry read new, the pending entry's
// times-delivered for one claimed from another consumer (XCLAIM counts the
// claim) and for one nacked. Where no dedupe store counts attempts, a
// message that kills every consumer it reaches is then dead-lettered after
// MaxAttempts deliveries instead of looping.
//
//	sub, err := redissub.NewSubscriber(redissub.Config{
//		Client:        client,
//		ConsumerGroup: "orders",
//	}, logger)
//
// With pipeline, give it to HandleTx or HandleBatchTx with
// Config.Concurrency 1: pipeline reads InFlight to size the batches.
// Measured with settle's transactional handler on PostgreSQL, one
// subscription of InFlight 16 is no faster than watermill-redisstream's
// subscriber at Concurrency 16, per message or batched: the commits bound
// the rate (docs/brokers.md). Choose it for the delivery count and for
// the entries it keeps from being claimed away.
//
// An acked message's entry is acknowledged (XACK). A nacked one is claimed
// again by the same consumer (XCLAIM, which Redis counts as a delivery) and
// handed to the router at once: Redis has no delayed redelivery, and the
// retry middleware's RedeliveryDelay is the wait, spent before the nack. An
// entry whose consumer died stays pending; a live consumer claims it once it
// has been idle MaxIdleTime, at its next look (every ClaimInterval). While
// a message is in the router its entry is kept from going idle (XCLAIM
// JUSTID, every MaxIdleTime/4, for entries this consumer still owns), so
// MaxIdleTime bounds the wait after a crash without bounding how long a
// handler may run. Entries read ahead are held the same way. The subscriber never deletes a consumer: XGROUP
// DELCONSUMER drops the entries a consumer holds (see SubscriberConfig).
//
// # What it does not guarantee
//
// An entry the Unmarshaller refuses stays pending, neither acked nor
// parked: it is claimed again every MaxIdleTime and logged each time. A
// subscriber that stops answering for MaxIdleTime without dying (Redis
// unreachable, the process stopped) has its entries claimed by another
// consumer while it still holds them; settle's dedupe runs the effect once,
// and the later ack removes the entry. Entries of one subscription are
// handled concurrently and may finish in any order. What Redis keeps across
// its own restart is its persistence settings' business (appendonly): a
// stream or a pending entry Redis lost is not redelivered.
package redissub
