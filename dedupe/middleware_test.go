package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
)

// waitTimeout bounds every wait for a condition; a test that needs longer
// is broken, not slow.
const waitTimeout = 10 * time.Second

// storeCase is a store under test and a way to count the keys it holds.
type storeCase struct {
	name string
	new  func(t *testing.T) (dedupe.Store, func() int)
}

func storeCases() []storeCase {
	return []storeCase{
		{"memory", func(t *testing.T) (dedupe.Store, func() int) {
			s := dedupe.NewMemoryStore()
			return s, func() int { return dedupe.MemoryLen(s) }
		}},
		{"sqlite", func(t *testing.T) (dedupe.Store, func() int) {
			db := testenv.SQLite(t)
			table := testenv.DedupeTable(t, db)
			s, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			return s, func() int {
				var n int
				if err := db.QueryRowContext(context.Background(), `SELECT COUNT(*) FROM "`+table+`"`).Scan(&n); err != nil {
					t.Errorf("count keys: %v", err)
				}
				return n
			}
		}},
	}
}

func newMiddleware(t *testing.T, cfg dedupe.Config) message.HandlerMiddleware {
	t.Helper()
	mw, err := dedupe.NewMiddleware(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

func newMsg(t *testing.T, uuid string) *message.Message {
	msg := message.NewMessage(uuid, []byte("payload"))
	msg.SetContext(t.Context())
	return msg
}

// delivery is what an outer middleware saw for one delivery.
type delivery struct {
	result  dedupe.Result // zero when there was no claim
	attempt int
	err     error
}

// recorder is an outer middleware that records the claim and the error of
// each delivery after the inner chain returned: nil error means the router
// acks, an error means it nacks.
type recorder struct {
	mu sync.Mutex
	d  []delivery
}

func (r *recorder) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		c, _ := dedupe.ClaimFromContext(msg.Context())
		r.mu.Lock()
		r.d = append(r.d, delivery{result: c.Result, attempt: c.Attempt, err: err})
		r.mu.Unlock()
		return out, err
	}
}

func (r *recorder) deliveries() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivery(nil), r.d...)
}

// startRouter runs a real Watermill router with one consumer handler on
// topic of a GoChannel whose Publish blocks until the message is acked, and
// closes both when the test ends.
func startRouter(t *testing.T, topic string, h message.NoPublishHandlerFunc, mws ...message.HandlerMiddleware) *gochannel.GoChannel {
	t.Helper()
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: waitTimeout}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mws...)
	r.AddConsumerHandler("dedupe_test", topic, pubSub, h)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
		if err := pubSub.Close(); err != nil {
			t.Errorf("close gochannel: %v", err)
		}
	})
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(waitTimeout):
		t.Fatal("router did not start")
	}
	return pubSub
}

// publishAcked publishes msg and returns once a subscriber acked it: the
// GoChannel blocks Publish until then and redelivers on nack.
func publishAcked(t *testing.T, pub message.Publisher, topic string, msg *message.Message) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- pub.Publish(topic, msg) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("publish: %v", err)
		}
	case <-time.After(waitTimeout):
		t.Fatalf("message %s was not acked within %v", msg.UUID, waitTimeout)
	}
}

func TestMiddlewareRunsSameMessageOnce(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, _ := sc.new(t)
			var calls, effects atomic.Int32
			rec := &recorder{}
			pub := startRouter(t, "orders", func(msg *message.Message) error {
				calls.Add(1)
				effects.Add(1)
				return nil
			}, rec.middleware, newMiddleware(t, dedupe.Config{Store: store}))

			uuid := watermill.NewUUID()
			publishAcked(t, pub, "orders", message.NewMessage(uuid, []byte("a")))
			publishAcked(t, pub, "orders", message.NewMessage(uuid, []byte("a")))

			if n := calls.Load(); n != 1 {
				t.Errorf("handler calls = %d, want 1", n)
			}
			if n := effects.Load(); n != 1 {
				t.Errorf("effects = %d, want 1", n)
			}
			want := []delivery{{result: dedupe.Acquired, attempt: 1}, {result: dedupe.Duplicate, attempt: 1}}
			if got := rec.deliveries(); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("deliveries = %v, want %v (both acked)", got, want)
			}
			c, err := store.Claim(t.Context(), dedupe.ScopedKey("dedupe_test", uuid), time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if c.Result != dedupe.Duplicate {
				t.Errorf("store says %v for the key, want duplicate", c.Result)
			}
		})
	}
}

var errFirstDelivery = errors.New("first delivery fails")

// failOnce returns a handler that fails on its first call and counts one
// effect on each later successful call.
func failOnce(calls, effects *atomic.Int32) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			return errFirstDelivery
		}
		effects.Add(1)
		return nil
	}
}

func TestMiddlewareRedeliveryOfFailedMessageDoesTheWork(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, _ := sc.new(t)
			var calls, effects atomic.Int32
			rec := &recorder{}
			pub := startRouter(t, "orders", failOnce(&calls, &effects),
				rec.middleware, newMiddleware(t, dedupe.Config{Store: store}))

			uuid := watermill.NewUUID()
			publishAcked(t, pub, "orders", message.NewMessage(uuid, []byte("a")))

			if n := calls.Load(); n != 2 {
				t.Errorf("handler calls = %d, want 2", n)
			}
			if n := effects.Load(); n != 1 {
				t.Errorf("effects = %d, want 1", n)
			}
			got := rec.deliveries()
			if len(got) != 2 || !errors.Is(got[0].err, errFirstDelivery) || got[0].result != dedupe.Acquired ||
				got[1].err != nil || got[1].result != dedupe.Acquired || got[1].attempt != 2 {
				t.Errorf("deliveries = %v, want [nacked acquired attempt 1, acked acquired attempt 2]", got)
			}
			c, err := store.Claim(t.Context(), dedupe.ScopedKey("dedupe_test", uuid), time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if c.Result != dedupe.Duplicate {
				t.Errorf("store says %v for the key, want duplicate", c.Result)
			}
		})
	}
}

// TestWatermillDeduplicatorLosesFailedMessage is the reason settle's dedupe
// exists. Watermill's middleware.Deduplicator (v1.5.1) records the key before
// the handler runs, so when the handler fails the redelivery is dropped as a
// duplicate and acked: the work is lost. The test asserts the loss, so if it
// ever fails, Watermill has changed this behaviour and the docs that cite it
// must be revised.
func TestWatermillDeduplicatorLosesFailedMessage(t *testing.T) {
	t.Parallel()
	var calls, effects atomic.Int32
	rec := &recorder{}
	dedup := &middleware.Deduplicator{
		KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
	}
	pub := startRouter(t, "orders", failOnce(&calls, &effects), rec.middleware, dedup.Middleware)

	publishAcked(t, pub, "orders", message.NewMessage(watermill.NewUUID(), []byte("a")))

	if n := calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1 (the redelivery is dropped)", n)
	}
	if n := effects.Load(); n != 0 {
		t.Errorf("effects = %d, want 0 (the work is lost)", n)
	}
	got := rec.deliveries()
	if len(got) != 2 || !errors.Is(got[0].err, errFirstDelivery) || got[1].err != nil {
		t.Errorf("deliveries = %v, want [nacked, acked without running]", got)
	}
}

func TestMiddlewareBusyKeyIsNotAcked(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, _ := sc.new(t)
			entered, release := make(chan struct{}), make(chan struct{})
			holder := newMiddleware(t, dedupe.Config{Store: store})(func(msg *message.Message) ([]*message.Message, error) {
				close(entered)
				<-release
				return nil, nil
			})
			var otherCalls atomic.Int32
			other := newMiddleware(t, dedupe.Config{Store: store})(func(msg *message.Message) ([]*message.Message, error) {
				otherCalls.Add(1)
				return nil, nil
			})

			uuid := watermill.NewUUID()
			done := make(chan error, 1)
			go func() {
				_, err := holder(newMsg(t, uuid))
				done <- err
			}()
			select {
			case <-entered:
			case <-time.After(waitTimeout):
				t.Fatal("holder did not start")
			}

			busy := newMsg(t, uuid)
			_, err := other(busy)
			if !errors.Is(err, dedupe.ErrBusy) {
				t.Errorf("second delivery error = %v, want ErrBusy (nack, never ack)", err)
			}
			if c, _ := dedupe.ClaimFromContext(busy.Context()); c.Result != dedupe.Busy {
				t.Errorf("second delivery claim = %v, want busy", c.Result)
			}
			if n := otherCalls.Load(); n != 0 {
				t.Errorf("handler ran %d times on a busy key", n)
			}

			close(release)
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("holder: %v", err)
				}
			case <-time.After(waitTimeout):
				t.Fatal("holder did not return")
			}

			again := newMsg(t, uuid)
			if _, err := other(again); err != nil {
				t.Errorf("redelivery after confirm: %v", err)
			}
			if c, _ := dedupe.ClaimFromContext(again.Context()); c.Result != dedupe.Duplicate {
				t.Errorf("redelivery claim = %v, want duplicate", c.Result)
			}
			if n := otherCalls.Load(); n != 0 {
				t.Errorf("handler ran %d times on a confirmed key", n)
			}
		})
	}
}

func TestMiddlewareRefusesBadKeys(t *testing.T) {
	t.Parallel()
	keys := []struct {
		name string
		key  dedupe.KeyFunc
		want error
	}{
		{"empty", func(*message.Message) (string, error) { return "", nil }, dedupe.ErrEmptyKey},
		{"too long", func(*message.Message) (string, error) { return strings.Repeat("k", dedupe.MaxKeyLen+1), nil }, dedupe.ErrKeyTooLong},
		{"missing metadata", dedupe.MetadataKey("order_id", "order:"), dedupe.ErrEmptyKey},
	}
	for _, sc := range storeCases() {
		for _, k := range keys {
			t.Run(sc.name+"/"+k.name, func(t *testing.T) {
				t.Parallel()
				store, count := sc.new(t)
				var calls atomic.Int32
				h := newMiddleware(t, dedupe.Config{Store: store, Key: k.key})(func(msg *message.Message) ([]*message.Message, error) {
					calls.Add(1)
					return nil, nil
				})
				_, err := h(newMsg(t, watermill.NewUUID()))
				if !errors.Is(err, k.want) {
					t.Errorf("error = %v, want %v", err, k.want)
				}
				var ke *dedupe.KeyError
				if !errors.As(err, &ke) || !ke.Permanent() {
					t.Errorf("error %v is not a permanent *dedupe.KeyError", err)
				}
				if n := calls.Load(); n != 0 {
					t.Errorf("handler ran %d times", n)
				}
				if n := count(); n != 0 {
					t.Errorf("store holds %d keys, want 0", n)
				}
			})
		}
	}
}

func TestMiddlewareReleasesClaimOnPanic(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			store, _ := sc.new(t)
			type boom struct{}
			h := newMiddleware(t, dedupe.Config{Store: store})(func(msg *message.Message) ([]*message.Message, error) {
				panic(boom{})
			})
			uuid := watermill.NewUUID()
			recovered := func() (r any) {
				defer func() { r = recover() }()
				_, _ = h(newMsg(t, uuid))
				return nil
			}()
			if _, ok := recovered.(boom); !ok {
				t.Fatalf("recovered %v, want the handler's panic", recovered)
			}

			// Watermill's Recoverer outside turns the same panic into an error
			// (the router nacks) and the key is released again.
			_, err := middleware.Recoverer(h)(newMsg(t, uuid))
			var rp middleware.RecoveredPanicError
			if !errors.As(err, &rp) {
				t.Errorf("Recoverer returned %v, want RecoveredPanicError", err)
			}

			c, err := store.Claim(t.Context(), uuid, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if c.Result != dedupe.Acquired || c.Attempt != 3 {
				t.Errorf("claim after two panics = %v attempt %d, want acquired attempt 3", c.Result, c.Attempt)
			}
		})
	}
}

// TestMiddlewareRenewsClaimOfLongHandler is about time, with a claim timeout
// of 250ms renewed every 20ms: it runs alone (not in parallel with the other
// tests of the package, nor its subtests with each other). Still, on a loaded
// machine (other packages' tests beside it, SQLite's writes waiting on each
// other) a renewal can come more than 230ms late, and then the other worker
// takes the key over rightly. The test tells the two apart by when the last
// write that set the claim's expiry began (the middleware's claim, then each
// renewal that succeeded, timed by clockedStore): a key given away sooner
// than the claim timeout after that fails it; a late renewal proves nothing
// either way, and the attempt starts again on a new message, as
// dedupetest's RenewalPreventsTakeover does.
func TestMiddlewareRenewsClaimOfLongHandler(t *testing.T) {
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			store, _ := sc.new(t)
			for attempt := range 5 {
				if renewsLongHandler(t, store) {
					return
				}
				t.Logf("attempt %d: a renewal came later than the claim timeout; again on a new message", attempt+1)
			}
			t.Fatal("every attempt had a renewal later than the claim timeout")
		})
	}
}

// renewsLongHandler is one attempt of TestMiddlewareRenewsClaimOfLongHandler.
// It reports false when the claim lapsed because a renewal came late.
func renewsLongHandler(t *testing.T, store dedupe.Store) bool {
	const claimTimeout = 250 * time.Millisecond
	w := new(writeClock)
	entered, release := make(chan struct{}), make(chan struct{})
	cfg := dedupe.Config{Store: clocked(t, store, w), ClaimTimeout: claimTimeout, RenewInterval: 20 * time.Millisecond}
	h := newMiddleware(t, cfg)(func(msg *message.Message) ([]*message.Message, error) {
		close(entered)
		select {
		case <-release:
			return nil, nil
		case <-msg.Context().Done():
			return nil, context.Cause(msg.Context())
		}
	})
	uuid := watermill.NewUUID()
	done := make(chan error, 1)
	go func() {
		_, err := h(newMsg(t, uuid))
		done <- err
	}()
	<-entered
	handlerDone := func() error {
		select {
		case err := <-done:
			return err
		case <-time.After(waitTimeout):
			t.Fatal("handler did not return")
			return nil
		}
	}

	// For five claim timeouts another worker must find the key busy.
	start := time.Now()
	polls := 0
	for time.Since(start) < 5*claimTimeout {
		c, err := store.Claim(t.Context(), uuid, claimTimeout)
		if err != nil {
			t.Fatal(err)
		}
		polls++
		if c.Result != dedupe.Busy {
			if since := w.since(); since < claimTimeout || c.Result != dedupe.Acquired {
				t.Fatalf("another worker's claim %v after the last renewal began = %v, want busy", since, c.Result)
			}
			close(release)
			_ = handlerDone() // cancelled, or finished, with its claim lost
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	if err := handlerDone(); err != nil {
		t.Fatalf("handler after renewals: %v", err)
	}
	c, err := store.Claim(t.Context(), uuid, claimTimeout)
	if err != nil {
		t.Fatal(err)
	}
	if c.Result != dedupe.Duplicate {
		t.Errorf("claim after confirm = %v, want duplicate", c.Result)
	}
	if polls < 10 {
		t.Errorf("only %d polls in %v", polls, 5*claimTimeout)
	}
	return true
}

// writeClock records when the last write that set a claim's expiry began.
type writeClock struct{ last atomic.Int64 }

func (w *writeClock) wrote(start time.Time) { w.last.Store(start.UnixNano()) }

// since is the time since the last write began: the claim expires no
// sooner than its lifetime after that.
func (w *writeClock) since() time.Duration { return time.Since(time.Unix(0, w.last.Load())) }

// clocked is store with its acquiring claims and successful renewals timed
// by w. It embeds the store's own type, so that the middleware sees the
// store it is (in the process, or SQLite) and treats it the same.
func clocked(t *testing.T, store dedupe.Store, w *writeClock) dedupe.Store {
	switch s := store.(type) {
	case *dedupe.MemoryStore:
		return clockedMemory{s, w}
	case *dedupe.SQLStore[*sql.Tx]:
		return clockedSQL{s, w}
	}
	t.Fatalf("clocked: a store of type %T", store)
	return nil
}

type clockedMemory struct {
	*dedupe.MemoryStore
	w *writeClock
}

func (s clockedMemory) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	return timeClaim(s.w, func() (dedupe.Claim, error) { return s.MemoryStore.Claim(ctx, key, ttl) })
}

func (s clockedMemory) Renew(ctx context.Context, c dedupe.Claim, ttl time.Duration) error {
	return timeRenew(s.w, func() error { return s.MemoryStore.Renew(ctx, c, ttl) })
}

type clockedSQL struct {
	*dedupe.SQLStore[*sql.Tx]
	w *writeClock
}

func (s clockedSQL) Claim(ctx context.Context, key string, ttl time.Duration) (dedupe.Claim, error) {
	return timeClaim(s.w, func() (dedupe.Claim, error) { return s.SQLStore.Claim(ctx, key, ttl) })
}

func (s clockedSQL) Renew(ctx context.Context, c dedupe.Claim, ttl time.Duration) error {
	return timeRenew(s.w, func() error { return s.SQLStore.Renew(ctx, c, ttl) })
}

func timeClaim(w *writeClock, claim func() (dedupe.Claim, error)) (dedupe.Claim, error) {
	start := time.Now()
	c, err := claim()
	if err == nil && c.Result == dedupe.Acquired {
		w.wrote(start)
	}
	return c, err
}

func timeRenew(w *writeClock, renew func() error) error {
	start := time.Now()
	err := renew()
	if err == nil {
		w.wrote(start)
	}
	return err
}

// lostStore is a Store whose renewals find the claim taken over by another
// worker.
type lostStore struct {
	dedupe.Store
	renews atomic.Int32
}

func (s *lostStore) Renew(context.Context, dedupe.Claim, time.Duration) error {
	s.renews.Add(1)
	return dedupe.ErrClaimLost
}

func TestMiddlewareCancelsHandlerWhenClaimLost(t *testing.T) {
	t.Parallel()
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			inner, _ := sc.new(t)
			store := &lostStore{Store: inner}
			var cause error
			h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 60 * time.Millisecond})(func(msg *message.Message) ([]*message.Message, error) {
				select {
				case <-msg.Context().Done():
					cause = context.Cause(msg.Context())
					return nil, msg.Context().Err()
				case <-time.After(waitTimeout):
					return nil, errors.New("handler context was not cancelled")
				}
			})
			msg := newMsg(t, watermill.NewUUID())
			_, err := h(msg)
			if !errors.Is(cause, dedupe.ErrClaimLost) {
				t.Errorf("context cause = %v, want ErrClaimLost", cause)
			}
			if !errors.Is(err, context.Canceled) {
				t.Errorf("delivery error = %v, want the handler's context.Canceled (nack)", err)
			}
			if n := store.renews.Load(); n != 1 {
				t.Errorf("renewals = %d, want 1 (renewal stops once the claim is lost)", n)
			}
			if err := msg.Context().Err(); err != nil {
				t.Errorf("outer context after return: %v, want the original, uncancelled context", err)
			}
		})
	}
}

// downStore is a Store whose renewals fail as if the database were
// unreachable.
type downStore struct {
	dedupe.Store
	renews atomic.Int32
}

var errDatabaseDown = errors.New("database down")

func (s *downStore) Renew(context.Context, dedupe.Claim, time.Duration) error {
	s.renews.Add(1)
	return errDatabaseDown
}

// A handler whose renewals keep failing must not run on once its claim has
// expired: another worker may have taken the key over.
func TestMiddlewareCancelsHandlerWhenClaimExpiresUnrenewed(t *testing.T) {
	t.Parallel()
	const claimTimeout = 90 * time.Millisecond
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			inner, _ := sc.new(t)
			store := &downStore{Store: inner}
			var cause error
			var expiresAt, cancelledAt time.Time
			h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: claimTimeout})(func(msg *message.Message) ([]*message.Message, error) {
				c, _ := dedupe.ClaimFromContext(msg.Context())
				expiresAt = c.ExpiresAt
				select {
				case <-msg.Context().Done():
					cancelledAt = time.Now()
					cause = context.Cause(msg.Context())
					return nil, msg.Context().Err()
				case <-time.After(waitTimeout):
					return nil, errors.New("handler context was not cancelled")
				}
			})
			if _, err := h(newMsg(t, watermill.NewUUID())); !errors.Is(err, context.Canceled) {
				t.Errorf("delivery error = %v, want the handler's context.Canceled (nack)", err)
			}
			if !errors.Is(cause, dedupe.ErrClaimLost) || !errors.Is(cause, errDatabaseDown) {
				t.Errorf("context cause = %v, want ErrClaimLost wrapping the renewal error", cause)
			}
			if cancelledAt.Before(expiresAt) {
				t.Errorf("handler cancelled at %v, before its claim expired at %v", cancelledAt, expiresAt)
			}
			if n := store.renews.Load(); n < 2 {
				t.Errorf("renewals = %d, want retries before giving up", n)
			}
		})
	}
}

func TestNewMiddlewareRefusesBadConfig(t *testing.T) {
	t.Parallel()
	store := dedupe.NewMemoryStore()
	cases := []struct {
		name  string
		cfg   dedupe.Config
		field string
	}{
		{"nil store", dedupe.Config{}, "Config.Store"},
		{"claim timeout 1ms", dedupe.Config{Store: store, ClaimTimeout: time.Millisecond}, "Config.ClaimTimeout"},
		{"negative claim timeout", dedupe.Config{Store: store, ClaimTimeout: -time.Second}, "Config.ClaimTimeout"},
		{"renew equals claim timeout", dedupe.Config{Store: store, ClaimTimeout: time.Second, RenewInterval: time.Second}, "Config.RenewInterval"},
		{"renew above claim timeout", dedupe.Config{Store: store, ClaimTimeout: time.Second, RenewInterval: 2 * time.Second}, "Config.RenewInterval"},
		{"renew above default claim timeout", dedupe.Config{Store: store, RenewInterval: time.Minute}, "Config.RenewInterval"},
		{"negative renew", dedupe.Config{Store: store, RenewInterval: -time.Second}, "Config.RenewInterval"},
		{"negative settle timeout", dedupe.Config{Store: store, SettleTimeout: -time.Second}, "Config.SettleTimeout"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			mw, err := dedupe.NewMiddleware(c.cfg)
			if err == nil {
				t.Fatal("config accepted")
			}
			if mw != nil {
				t.Error("middleware returned with an error")
			}
			if !strings.Contains(err.Error(), c.field) {
				t.Errorf("error %q does not name %s", err, c.field)
			}
		})
	}
	t.Run("defaults", func(t *testing.T) {
		t.Parallel()
		if _, err := dedupe.NewMiddleware(dedupe.Config{Store: store}); err != nil {
			t.Errorf("config with only a store refused: %v", err)
		}
	})
}

func TestClaimFromContext(t *testing.T) {
	t.Parallel()
	if _, ok := dedupe.ClaimFromContext(context.Background()); ok {
		t.Error("claim found in a context the middleware never saw")
	}
	store := dedupe.NewMemoryStore()
	var inHandler dedupe.Claim
	var inHandlerOK bool
	h := newMiddleware(t, dedupe.Config{Store: store})(func(msg *message.Message) ([]*message.Message, error) {
		inHandler, inHandlerOK = dedupe.ClaimFromContext(msg.Context())
		return nil, nil
	})
	var outer dedupe.Claim
	var outerOK bool
	wrapped := func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		outer, outerOK = dedupe.ClaimFromContext(msg.Context())
		return out, err
	}

	uuid := watermill.NewUUID()
	if _, err := wrapped(newMsg(t, uuid)); err != nil {
		t.Fatal(err)
	}
	if !inHandlerOK || inHandler.Result != dedupe.Acquired || inHandler.Key != uuid || inHandler.Attempt != 1 || inHandler.Token == "" {
		t.Errorf("handler saw %+v (ok %v), want the acquired claim of %s", inHandler, inHandlerOK, uuid)
	}
	if !outerOK || outer != inHandler {
		t.Errorf("outer middleware saw %+v (ok %v), want %+v", outer, outerOK, inHandler)
	}

	if _, err := wrapped(newMsg(t, uuid)); err != nil {
		t.Fatal(err)
	}
	if !outerOK || outer.Result != dedupe.Duplicate || outer.Key != uuid {
		t.Errorf("outer middleware saw %+v (ok %v) for the duplicate, want a duplicate claim", outer, outerOK)
	}
}

// renewFails is a store whose renewals fail as a database outage would.
type renewFails struct{ dedupe.Store }

func (renewFails) Renew(context.Context, dedupe.Claim, time.Duration) error {
	return errors.New("connection refused")
}

// A claim can be lost two ways: a renewal finds another owner, or renewals
// fail until the claim expires. Either way the handler is cancelled, and
// whatever it returns (often just its context's error), the middleware's
// error is ErrClaimLost.
func TestLostClaimIsErrClaimLostWhateverTheHandlerReturns(t *testing.T) {
	t.Parallel()
	store := renewFails{dedupe.NewMemoryStore()}
	h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 100 * time.Millisecond, RenewInterval: 20 * time.Millisecond})(
		func(msg *message.Message) ([]*message.Message, error) {
			<-msg.Context().Done()
			return nil, msg.Context().Err() // a bare context.Canceled
		})
	_, err := h(newMsg(t, "expires"))
	if !errors.Is(err, dedupe.ErrClaimLost) {
		t.Fatalf("err = %v, want one that is ErrClaimLost", err)
	}
}

// The handler's context is made cancellable only when something waits on it;
// a handler that only polls Err must still see a lost claim, with its cause.
func TestClaimLostCancelsAHandlerThatNeverWaits(t *testing.T) {
	t.Parallel()
	store := &lostStore{Store: dedupe.NewMemoryStore()}
	var err, cause error
	h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 60 * time.Millisecond})(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		for deadline := time.Now().Add(waitTimeout); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if err = ctx.Err(); err != nil {
				cause = context.Cause(ctx)
				return nil, err
			}
		}
		return nil, errors.New("handler context was not cancelled")
	})
	_, derr := h(newMsg(t, watermill.NewUUID()))
	if !errors.Is(err, context.Canceled) || !errors.Is(cause, dedupe.ErrClaimLost) {
		t.Errorf("handler saw Err %v, cause %v; want context.Canceled caused by ErrClaimLost", err, cause)
	}
	if !errors.Is(derr, dedupe.ErrClaimLost) {
		t.Errorf("delivery error = %v, want ErrClaimLost", derr)
	}
}

// The handler's context follows the message's context, and ends when the
// handler returns, whether or not the handler waited on it; the message's
// context outside stays as it was.
func TestHandlerContextFollowsParentAndEndsOnReturn(t *testing.T) {
	t.Parallel()
	for _, wait := range []bool{false, true} {
		t.Run(fmt.Sprintf("waits=%v", wait), func(t *testing.T) {
			t.Parallel()
			h := newMiddleware(t, dedupe.Config{Store: dedupe.NewMemoryStore()})

			// Cancelling the message's context cancels the handler's.
			parent, cancelParent := context.WithCancelCause(t.Context())
			errStop := errors.New("router stopping")
			var seen, seenCause error
			run := h(func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := ctx.Err(); err != nil {
					return nil, fmt.Errorf("context done before the parent was cancelled: %w", err)
				}
				cancelParent(errStop)
				if wait {
					select {
					case <-ctx.Done():
					case <-time.After(waitTimeout):
					}
				}
				seen, seenCause = ctx.Err(), context.Cause(ctx)
				return nil, nil
			})
			msg := newMsg(t, watermill.NewUUID())
			msg.SetContext(parent)
			_, _ = run(msg)
			if !errors.Is(seen, context.Canceled) || !errors.Is(seenCause, errStop) {
				t.Errorf("after the parent was cancelled the handler saw Err %v, cause %v; want context.Canceled caused by %v", seen, seenCause, errStop)
			}

			// After the handler returns its context is done, and so is a
			// child made from it; the message's context is not.
			var hctx, child context.Context
			run = h(func(msg *message.Message) ([]*message.Message, error) {
				hctx = msg.Context()
				if wait {
					var cancel context.CancelFunc
					child, cancel = context.WithCancel(hctx)
					t.Cleanup(cancel)
				}
				return nil, nil
			})
			msg = newMsg(t, watermill.NewUUID())
			if _, err := run(msg); err != nil {
				t.Fatal(err)
			}
			if err := hctx.Err(); !errors.Is(err, context.Canceled) {
				t.Errorf("handler's context after return: Err = %v, want context.Canceled", err)
			}
			select {
			case <-hctx.Done():
			default:
				t.Error("handler's context after return: Done is not closed")
			}
			if c := context.Cause(hctx); !errors.Is(c, context.Canceled) || errors.Is(c, dedupe.ErrClaimLost) {
				t.Errorf("handler's context after return: cause = %v, want context.Canceled", c)
			}
			if _, ok := dedupe.ClaimFromContext(hctx); !ok {
				t.Error("handler's context after return does not carry the claim")
			}
			if child != nil && !errors.Is(child.Err(), context.Canceled) {
				t.Errorf("child of the handler's context after return: Err = %v, want context.Canceled", child.Err())
			}
			if err := msg.Context().Err(); err != nil {
				t.Errorf("message context after return: %v, want the original, uncancelled context", err)
			}
		})
	}
}

// countingStore counts the renewals of each key.
type countingStore struct {
	dedupe.Store
	mu     sync.Mutex
	renews map[string]int
}

func (s *countingStore) Renew(ctx context.Context, c dedupe.Claim, ttl time.Duration) error {
	s.mu.Lock()
	s.renews[c.Key]++
	s.mu.Unlock()
	return s.Store.Renew(ctx, c, ttl)
}

// The renewals of many handlers running at once share one schedule: those
// that finish early leave it, the others stay renewed for as long as they
// run.
func TestMiddlewareRenewsManyHandlersAtOnce(t *testing.T) {
	t.Parallel()
	const interval = 20 * time.Millisecond
	store := &countingStore{Store: dedupe.NewMemoryStore(), renews: map[string]int{}}
	h := newMiddleware(t, dedupe.Config{Store: store, ClaimTimeout: 10 * interval, RenewInterval: interval})(
		func(msg *message.Message) ([]*message.Message, error) {
			d, _ := time.ParseDuration(msg.Metadata.Get("run"))
			select {
			case <-time.After(d):
				return nil, nil
			case <-msg.Context().Done():
				return nil, context.Cause(msg.Context())
			}
		})
	const n = 24
	runs := make([]time.Duration, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		runs[i] = []time.Duration{0, interval / 4, 8 * interval, 12 * interval}[i%4]
		msg := newMsg(t, fmt.Sprintf("many-%02d", i))
		msg.Metadata.Set("run", runs[i].String())
		wg.Go(func() {
			if _, err := h(msg); err != nil {
				errs <- fmt.Errorf("%s: %w", msg.UUID, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	for i, d := range runs {
		key := dedupe.ScopedKey("", fmt.Sprintf("many-%02d", i))
		got := store.renews[key]
		switch {
		case d >= 8*interval && got < 3:
			t.Errorf("%s ran %v and was renewed %d times, want at least 3 (every %v)", key, d, got, interval)
		case d < interval/2 && got > 1:
			t.Errorf("%s ran %v and was renewed %d times, want at most 1", key, d, got)
		}
	}
}
