package dedupetest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
)

// testHandlerScopes runs the dedupe middleware on the store in a real
// router where two handlers consume the same topic (GoChannel gives each
// subscription every message), and delivers every message twice. Each
// handler must run each message exactly once: the two handlers' keys are
// scoped apart, and each handler's redelivery is a duplicate.
func testHandlerScopes(t *testing.T, h Harness) {
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	mustOK(t, "NewRouter", err)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: h.Store})
	mustOK(t, "NewMiddleware", err)
	router.AddMiddleware(dd)
	var mu sync.Mutex
	runs := map[string]int{}
	for _, name := range []string{"charge", "email"} {
		router.AddConsumerHandler(name, "orders", ps, func(msg *message.Message) error {
			mu.Lock()
			runs[name+" "+msg.UUID]++
			mu.Unlock()
			return nil
		})
	}
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	<-router.Running()
	defer func() {
		mustOK(t, "router Close", router.Close())
		mustOK(t, "router Run", <-done)
		mustOK(t, "GoChannel Close", ps.Close())
	}()

	const n = 5
	for i := range n {
		for range 2 {
			mustOK(t, "Publish", ps.Publish("orders", message.NewMessage(fmt.Sprintf("scoped-%d", i), nil)))
		}
	}
	confirmed := func(handler, uuid string) bool {
		c, err := h.Store.Claim(t.Context(), dedupe.ScopedKey(handler, uuid), longTTL)
		mustOK(t, "Claim", err)
		if c.Result == dedupe.Acquired { // not done yet: give the key back
			mustOK(t, "Release", h.Store.Release(t.Context(), c))
		}
		return c.Result == dedupe.Duplicate
	}
	for i := range n {
		uuid := fmt.Sprintf("scoped-%d", i)
		for _, name := range []string{"charge", "email"} {
			eventually(t, 10*time.Second, name+" confirmed "+uuid, func() bool { return confirmed(name, uuid) })
		}
	}
	time.Sleep(50 * time.Millisecond) // second deliveries settle as duplicates
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		for _, name := range []string{"charge", "email"} {
			if got := runs[fmt.Sprintf("%s scoped-%d", name, i)]; got != 1 {
				t.Errorf("%s ran scoped-%d %d times, want 1", name, i, got)
			}
		}
	}
}

// testScopedKeysApart runs the dedupe middleware on the store with keys
// that the stored form of a scoped key could confuse: an unscoped key that
// spells handler charge's scoped key ("charge", NUL, "order-17"), and a
// scope that holds a NUL. Every (scope, key) pair is its own piece of work:
// each handler runs once, and none is taken for another's duplicate.
func testScopedKeysApart(t *testing.T, h Harness) {
	pairs := []struct{ scope, key string }{
		{"charge", "order-17"},
		{"", "charge\x00order-17"},
		{"", "\x000:charge\x00order-17"},
		{"charge\x00order", "-17"},
		{"charge\x00order-17", ""},
		{"charge", "\x00order-17"},
		{"", "order-17"},
		{"charge\x00", "order-17"},
	}
	runs := make([]int, len(pairs))
	run := func(i int) {
		p := pairs[i]
		dd, err := dedupe.NewMiddleware(dedupe.Config{
			Store: h.Store,
			Scope: dedupe.SharedScope(p.scope),
			Key:   func(*message.Message) (string, error) { return p.key, nil },
		})
		mustOK(t, "NewMiddleware", err)
		handler := dd(func(*message.Message) ([]*message.Message, error) {
			runs[i]++
			return nil, nil
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.SetContext(t.Context())
		_, err = handler(msg)
		if p.key == "" && p.scope != "" {
			// An empty key is refused, whatever the scope.
			if err == nil {
				t.Errorf("scope %q, empty key: handled, want a key error", p.scope)
			}
			return
		}
		mustOK(t, fmt.Sprintf("handler of scope %q key %q", p.scope, p.key), err)
	}
	for range 2 { // the second round: every key is a duplicate of its own first run
		for i := range pairs {
			run(i)
		}
	}
	for i, p := range pairs {
		want := 1
		if p.key == "" {
			want = 0
		}
		if runs[i] != want {
			t.Errorf("scope %q key %q: the handler ran %d times, want %d", p.scope, p.key, runs[i], want)
		}
	}
	seen := map[string]int{}
	for i, p := range pairs {
		k := dedupe.ScopedKey(p.scope, p.key)
		if j, ok := seen[k]; ok {
			t.Errorf("ScopedKey(%q, %q) = ScopedKey(%q, %q) = %q", p.scope, p.key, pairs[j].scope, pairs[j].key, k)
		}
		seen[k] = i
	}
}
