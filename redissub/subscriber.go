package redissub

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/deliverymark"
	"github.com/settle-go/settle/internal/settlement"
)

// Defaults of Config.
const (
	defaultInFlight      = 16
	defaultBlockTime     = 100 * time.Millisecond
	defaultMaxIdleTime   = 10 * time.Second
	defaultClaimInterval = time.Second
	minMaxIdleTime       = 100 * time.Millisecond
)

// ErrInvalidConfig is wrapped by the error NewSubscriber returns for a bad
// Config, and by CheckSubscriberConfig's.
var ErrInvalidConfig = errors.New("redissub: invalid config")

// Config configures a Subscriber.
type Config struct {
	// Client is the Redis client. Required. The subscriber does not own it:
	// Close leaves it open.
	Client redis.UniversalClient
	// ConsumerGroup is the consumer group every subscriber of a handler
	// shares; they compete for the stream's entries. Created (with the
	// stream) when missing, from OldestID. Required: without a group there
	// are no pending entries, so nothing is redelivered after a crash.
	ConsumerGroup string
	// Consumer names this subscriber in the group. Defaults to a random
	// name. A name kept across restarts (a pod's name) keeps the group's
	// consumer list short; two running subscribers must never share one.
	Consumer string
	// Unmarshaller turns a stream entry into a message. Defaults to
	// watermill-redisstream's DefaultMarshallerUnmarshaller, which reads
	// what its Publisher writes.
	Unmarshaller redisstream.Unmarshaller
	// InFlight is how many entries of one subscription are in the router at
	// once. As many more are read ahead (XREADGROUP COUNT), so that a batch's
	// successors are on the client when it is acked; they are pending for
	// this consumer meanwhile. Defaults to 16. Must be >= 1.
	InFlight int
	// BlockTime bounds one blocking XREADGROUP, and so how long Close waits
	// for a read to return. Defaults to 100ms. Must be > 0.
	BlockTime time.Duration
	// MaxIdleTime is how long a pending entry must have been idle before
	// another consumer claims it: the time a dead consumer's entries wait
	// before they are redelivered. The subscriber keeps the entries it has
	// in flight from going idle (XCLAIM JUSTID every MaxIdleTime/4), so a
	// live consumer's entries are not claimed away however long a handler
	// runs. Defaults to 10s. Must be >= 100ms, so that a heartbeat's round
	// trip to Redis lands well within it.
	MaxIdleTime time.Duration
	// ClaimInterval is how often the subscriber looks for entries idle
	// longer than MaxIdleTime (XPENDING IDLE) and claims them. A dead
	// consumer's entry is redelivered between MaxIdleTime and MaxIdleTime +
	// ClaimInterval after its last delivery. Defaults to 1s. Must be > 0.
	ClaimInterval time.Duration
	// OldestID is where a group created by Subscribe starts: "0", the whole
	// stream, or "$", only entries added after it. Defaults to "0".
	OldestID string
}

func (c *Config) setDefaults() {
	if c.Consumer == "" {
		c.Consumer = watermill.NewShortUUID()
	}
	if c.Unmarshaller == nil {
		c.Unmarshaller = redisstream.DefaultMarshallerUnmarshaller{}
	}
	if c.InFlight == 0 {
		c.InFlight = defaultInFlight
	}
	if c.BlockTime == 0 {
		c.BlockTime = defaultBlockTime
	}
	if c.MaxIdleTime == 0 {
		c.MaxIdleTime = defaultMaxIdleTime
	}
	if c.ClaimInterval == 0 {
		c.ClaimInterval = defaultClaimInterval
	}
	if c.OldestID == "" {
		c.OldestID = "0"
	}
}

func (c Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.Client == nil:
		return bad("Config.Client is nil")
	case c.ConsumerGroup == "":
		return bad("Config.ConsumerGroup is empty; without a group a crashed consumer's entries are never redelivered")
	case c.InFlight < 1:
		return bad("Config.InFlight must be >= 1, got %d", c.InFlight)
	case c.BlockTime <= 0:
		return bad("Config.BlockTime must be > 0, got %v", c.BlockTime)
	case c.MaxIdleTime < minMaxIdleTime:
		return bad("Config.MaxIdleTime must be >= %v, got %v", minMaxIdleTime, c.MaxIdleTime)
	case c.ClaimInterval <= 0:
		return bad("Config.ClaimInterval must be > 0, got %v", c.ClaimInterval)
	}
	return nil
}

// Subscriber is a Watermill subscriber for Redis Streams consumer groups
// that keeps up to Config.InFlight entries of each subscription in the
// router at once and gives each message the delivery count Redis keeps. See
// the package documentation.
type Subscriber struct {
	cfg    Config
	logger watermill.LoggerAdapter

	mu     sync.Mutex
	closed bool
	stop   chan struct{} // closed by Close
	subs   sync.WaitGroup
}

// NewSubscriber returns a subscriber, or an error wrapping ErrInvalidConfig
// that names the bad field. logger may be nil.
func NewSubscriber(cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Subscriber{cfg: cfg, logger: logger, stop: make(chan struct{})}, nil
}

// InFlight returns how many entries of one subscription the router may hold
// at once (Config.InFlight). pipeline reads it to size batches.
func (s *Subscriber) InFlight() int { return s.cfg.InFlight }

// Subscribe creates the stream and the consumer group if missing and
// returns the stream's messages. The channel is closed when the subscriber
// is closed or ctx is done, after every message of the subscription was
// answered or abandoned; an abandoned entry stays pending and is claimed
// after MaxIdleTime.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errors.New("redissub: subscriber is closed")
	}
	err := s.cfg.Client.XGroupCreateMkStream(ctx, topic, s.cfg.ConsumerGroup, s.cfg.OldestID).Err()
	if err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") { // the group exists
		return nil, fmt.Errorf("redissub: create group %q on %q: %w", s.cfg.ConsumerGroup, topic, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	st := &stream{
		s:        s,
		topic:    topic,
		out:      make(chan *message.Message),
		slots:    make(chan struct{}, 2*s.cfg.InFlight),
		router:   make(chan struct{}, s.cfg.InFlight),
		inFlight: map[string]bool{},
		fields:   watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup, "consumer": s.cfg.Consumer},
	}
	s.subs.Add(1)
	go func() {
		defer s.subs.Done()
		defer cancel()
		go func() {
			select {
			case <-s.stop:
			case <-ctx.Done():
			}
			cancel()
		}()
		st.run(ctx)
	}()
	return st.out, nil
}

// Close stops every subscription and waits until their channels are
// closed. Entries whose messages the router has not acked stay pending and
// are claimed by another consumer after MaxIdleTime. It does not close
// Config.Client.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.stop)
	s.mu.Unlock()
	s.subs.Wait()
	return nil
}

// stream is one subscription.
type stream struct {
	s     *Subscriber
	topic string
	out   chan *message.Message
	// slots holds one token per entry read and not yet answered: up to
	// InFlight in the router and as many read ahead, so that the entries
	// of the next batch are on the client when a batch is acked.
	slots chan struct{}
	// router holds one token per entry in the router.
	router chan struct{}
	fields watermill.LogFields

	mu       sync.Mutex
	inFlight map[string]bool // IDs of the entries read or claimed, not yet answered
	entries  sync.WaitGroup
}

func (st *stream) run(ctx context.Context) {
	defer close(st.out)
	defer st.entries.Wait()
	var loops sync.WaitGroup
	loops.Add(2)
	go func() { defer loops.Done(); st.claimLoop(ctx) }()
	go func() { defer loops.Done(); st.heartbeatLoop(ctx) }()
	st.readLoop(ctx)
	loops.Wait()
}

// acquire takes at least one slot, waiting for it, and then as many more
// as are free. It returns how many it took, 0 when ctx is done.
func (st *stream) acquire(ctx context.Context) int {
	select {
	case st.slots <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	n := 1
	for n < cap(st.slots) {
		select {
		case st.slots <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

func (st *stream) release(n int) {
	for range n {
		<-st.slots
	}
}

func (st *stream) readLoop(ctx context.Context) {
	cfg := &st.s.cfg
	for ctx.Err() == nil {
		n := st.acquire(ctx)
		if n == 0 {
			return
		}
		res, err := cfg.Client.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group:    cfg.ConsumerGroup,
			Consumer: cfg.Consumer,
			Streams:  []string{st.topic, ">"},
			Count:    int64(n),
			Block:    cfg.BlockTime,
		}).Result()
		if err != nil {
			st.release(n)
			if errors.Is(err, redis.Nil) || ctx.Err() != nil {
				continue
			}
			st.s.logger.Error("redissub: XREADGROUP failed", err, st.fields)
			settlement.Sleep(ctx, 500*time.Millisecond)
			continue
		}
		used := 0
		for _, xs := range res {
			for _, xm := range xs.Messages {
				used++
				// A first delivery: Redis counts it as one.
				st.deliver(ctx, xm, 1)
			}
		}
		st.release(n - used)
	}
}

// claimLoop claims, every ClaimInterval, the entries idle longer than
// MaxIdleTime (a dead consumer's), once at start too.
func (st *stream) claimLoop(ctx context.Context) {
	t := time.NewTicker(st.s.cfg.ClaimInterval)
	defer t.Stop()
	for {
		st.claim(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (st *stream) claim(ctx context.Context) {
	cfg := &st.s.cfg
	for ctx.Err() == nil {
		n := st.acquire(ctx)
		if n == 0 {
			return
		}
		pending, err := cfg.Client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: st.topic, Group: cfg.ConsumerGroup, Idle: cfg.MaxIdleTime,
			Start: "-", End: "+", Count: int64(n),
		}).Result()
		if err != nil {
			st.release(n)
			if ctx.Err() == nil {
				st.s.logger.Error("redissub: XPENDING failed", err, st.fields)
			}
			return
		}
		used := 0
		for _, p := range pending {
			st.mu.Lock()
			mine := st.inFlight[p.ID]
			st.mu.Unlock()
			if mine {
				// Held here, though idle (a heartbeat failed): it is
				// delivered already.
				continue
			}
			xm, ok := st.claimOne(ctx, p.ID, cfg.MaxIdleTime)
			if !ok {
				continue
			}
			used++
			// XCLAIM counted this delivery: the count XPENDING read is one
			// short of it.
			st.deliver(ctx, xm, p.RetryCount+1)
		}
		st.release(n - used)
		if len(pending) < n || used == 0 {
			return
		}
	}
}

// claimOne claims entry id for this consumer if it has been idle at least
// minIdle, and returns it. An entry whose message was deleted from the
// stream is acked: nothing is left to deliver.
func (st *stream) claimOne(ctx context.Context, id string, minIdle time.Duration) (redis.XMessage, bool) {
	cfg := &st.s.cfg
	xms, err := cfg.Client.XClaim(ctx, &redis.XClaimArgs{
		Stream: st.topic, Group: cfg.ConsumerGroup, Consumer: cfg.Consumer,
		MinIdle: minIdle, Messages: []string{id},
	}).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		if ctx.Err() == nil {
			st.s.logger.Error("redissub: XCLAIM failed", err, st.fields.Add(watermill.LogFields{"xid": id}))
		}
		return redis.XMessage{}, false
	}
	for _, xm := range xms {
		if xm.ID == id && xm.Values != nil {
			return xm, true
		}
	}
	if err == nil && len(xms) == 0 {
		// Claimed by another consumer meanwhile, or acked.
		return redis.XMessage{}, false
	}
	// The entry is pending but its message is gone (XDEL, XTRIM).
	if err := cfg.Client.XAck(ctx, st.topic, cfg.ConsumerGroup, id).Err(); err != nil && ctx.Err() == nil {
		st.s.logger.Error("redissub: XACK of a deleted entry failed", err, st.fields.Add(watermill.LogFields{"xid": id}))
	}
	return redis.XMessage{}, false
}

// heartbeat keeps this consumer's entries in flight from going idle, so
// that no other consumer claims them while their handlers run: XCLAIM
// JUSTID resets an entry's idle time without counting a delivery. The
// script claims only entries this consumer still owns.
var heartbeat = redis.NewScript(`
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
`)

func (st *stream) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(st.s.cfg.MaxIdleTime / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		st.mu.Lock()
		args := make([]any, 0, 2+len(st.inFlight))
		args = append(args, st.s.cfg.ConsumerGroup, st.s.cfg.Consumer)
		for id := range st.inFlight {
			args = append(args, id)
		}
		st.mu.Unlock()
		if len(args) == 2 {
			continue
		}
		if err := heartbeat.Run(ctx, st.s.cfg.Client, []string{st.topic}, args...).Err(); err != nil && ctx.Err() == nil {
			st.s.logger.Error("redissub: heartbeat of entries in flight failed", err, st.fields)
		}
	}
}

// deliver hands the entry to the router and answers it in a goroutine of
// its own: XACK on ack; on nack, XCLAIM to this consumer (Redis counts the
// redelivery) and hand it over again. It holds one slot, released when the
// entry is acked or abandoned.
func (st *stream) deliver(ctx context.Context, xm redis.XMessage, count int64) {
	st.mu.Lock()
	st.inFlight[xm.ID] = true
	st.mu.Unlock()
	st.entries.Add(1)
	go func() {
		defer st.entries.Done()
		defer st.release(1)
		defer func() {
			st.mu.Lock()
			delete(st.inFlight, xm.ID)
			st.mu.Unlock()
		}()
		st.serve(ctx, xm, count)
	}()
}

func (st *stream) serve(ctx context.Context, xm redis.XMessage, count int64) {
	fields := st.fields.Add(watermill.LogFields{"xid": xm.ID})
	for {
		msg, err := st.message(xm, count)
		if err != nil {
			// Left pending: claimed again after MaxIdleTime, and logged again.
			st.s.logger.Error("redissub: cannot unmarshal the entry; it stays pending", err, fields)
			return
		}
		select {
		case st.router <- struct{}{}:
		case <-ctx.Done():
			return
		}
		if !st.handOver(ctx, xm, msg, fields) {
			return
		}
		// Nacked: claim the entry again for this consumer, which counts the
		// redelivery, and read the count Redis now holds.
		next, ok := st.claimOne(ctx, xm.ID, 0)
		if !ok {
			return
		}
		n, err := st.deliveryCount(ctx, xm.ID)
		if err != nil {
			if ctx.Err() == nil {
				st.s.logger.Error("redissub: XPENDING of a nacked entry failed; it stays pending", err, fields)
			}
			return
		}
		xm, count = next, n
	}
}

// handOver sends msg to the router, holding a router token until the
// router answers, and then acks the entry on an ack, or reports a nack.
func (st *stream) handOver(ctx context.Context, xm redis.XMessage, msg *message.Message, fields watermill.LogFields) (nacked bool) {
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)
	select {
	case st.out <- msg:
	case <-ctx.Done():
		<-st.router
		return false
	}
	var acked bool
	select {
	case <-msg.Acked():
		acked = true
	case <-msg.Nacked():
		nacked = true
	case <-ctx.Done():
		select {
		case <-msg.Acked(): // acked before the close
			acked = true
		default:
		}
	}
	<-st.router // the next entry read ahead may enter the router
	if acked {
		st.ack(xm.ID, fields)
	}
	return nacked
}

// ack acknowledges the entry, retrying for a while: an entry acked in the
// router but not in Redis is delivered again after MaxIdleTime, which
// settle's dedupe answers as a duplicate.
func (st *stream) ack(id string, fields watermill.LogFields) {
	cfg := &st.s.cfg
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for {
		err := cfg.Client.XAck(ctx, st.topic, cfg.ConsumerGroup, id).Err()
		if err == nil {
			return
		}
		if !settlement.Sleep(ctx, 100*time.Millisecond) {
			st.s.logger.Error("redissub: XACK failed; the entry will be delivered again", err, fields)
			return
		}
	}
}

func (st *stream) deliveryCount(ctx context.Context, id string) (int64, error) {
	cfg := &st.s.cfg
	p, err := cfg.Client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: st.topic, Group: cfg.ConsumerGroup, Start: id, End: id, Count: 1,
	}).Result()
	if err != nil {
		return 0, err
	}
	if len(p) != 1 || p[0].ID != id {
		return 0, fmt.Errorf("entry %s is no longer pending", id)
	}
	return p[0].RetryCount, nil
}

// message unmarshals the entry and sets the metadata of this delivery:
// settle.MetaDeliveryCount with this process's mark, and
// settle.MetaRedelivered. Values of those keys in the entry are a
// producer's, and are dropped.
func (st *stream) message(xm redis.XMessage, count int64) (*message.Message, error) {
	msg, err := st.s.cfg.Unmarshaller.Unmarshal(xm.Values)
	if err != nil {
		return nil, err
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	c := strconv.FormatInt(count, 10)
	msg.Metadata[settle.MetaDeliveryCount] = c
	msg.Metadata[deliverymark.Meta] = deliverymark.Sign(msg.UUID, c)
	msg.Metadata[settle.MetaRedelivered] = strconv.FormatBool(count > 1)
	return msg, nil
}
