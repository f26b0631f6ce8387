package brokertest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/dedupe"
)

// errFail is the failure the suite's handlers return on purpose.
var errFail = errors.New("brokertest: handler failure on purpose")

// testDuplicateSequential: one message delivered twice, the second time
// after the first was done, has its effect once and its handler run once;
// both deliveries are acked.
func testDuplicateSequential(f *fixture, m mode) {
	c := f.startConsumer(m)
	id := watermill.NewUUID()
	f.publish(id, order(id))
	f.waitFor("the first delivery acked", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	f.publish(id, order(id))
	f.waitFor("the duplicate acked", func() (bool, string) { return f.count(f.acks, id) >= 2, f.state(id) })
	time.Sleep(settleGrace)
	if runs, fx := f.count(f.runs, id), f.effects(id); runs != 1 || fx != 1 {
		f.t.Errorf("two deliveries of one message: %d runs, %d effects; want 1 and 1 (%s)", runs, fx, f.state(id))
	}
	f.drained(c)
}

// testDuplicateConcurrent: messages each published twice, consumed by two
// consumers on separate connections, whose handler is slow enough that
// both copies of a message are in flight at once where the broker allows
// it: each message's effect is had once and its handler run once, and
// every copy is acked in the end (the second one deferred while the first
// holds the key, then acked as a duplicate).
func testDuplicateConcurrent(f *fixture, m mode) {
	f.setBehave(func(ctx context.Context, _ string, _ int) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
			return nil
		}
	})
	c1, c2 := f.startConsumer(m), f.startConsumer(m)
	const n = 6
	ids := make([]string, n)
	for i := range ids {
		ids[i] = watermill.NewUUID()
		f.publish(ids[i], order(ids[i]))
		f.publish(ids[i], order(ids[i]))
	}
	for _, id := range ids {
		f.waitFor("both copies acked", func() (bool, string) { return f.count(f.acks, id) >= 2, f.state(id) })
	}
	time.Sleep(settleGrace)
	overlapped := 0
	for _, id := range ids {
		if runs, fx := f.count(f.runs, id), f.effects(id); runs != 1 || fx != 1 {
			f.t.Errorf("two copies of one message on two consumers: %d runs, %d effects; want 1 and 1 (%s)", runs, fx, f.state(id))
		}
		if f.count(f.overlap, id) >= 2 {
			overlapped++
		}
	}
	// How many messages had both copies in flight at once: a broker that
	// hands a consumer group one message at a time (watermill-sql's
	// subscribers take turns on the group's offset row) has none.
	f.t.Logf("%d of %d messages had both copies in flight at once", overlapped, n)
	f.drained(c1, c2)
}

// testFailedFirstRun: a message whose first run fails is run again and
// has its effect once; the failed run's effect is rolled back (tx) or was
// never written (plain).
func testFailedFirstRun(f *fixture, m mode) {
	f.setBehave(func(_ context.Context, _ string, run int) error {
		if run == 1 {
			return errFail
		}
		return nil
	})
	dead := f.collect(f.dead)
	c := f.startConsumer(m)
	id := watermill.NewUUID()
	f.publish(id, order(id))
	f.waitFor("the message done", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	time.Sleep(settleGrace)
	if runs, fx := f.count(f.runs, id), f.effects(id); runs != 2 || fx != 1 {
		f.t.Errorf("first run failed: %d runs, %d effects; want 2 and 1 (%s)", runs, fx, f.state(id))
	}
	if n, _ := dead.count(id); n != 0 {
		f.t.Errorf("a message done on its second run has %d dead-letter copies, want 0", n)
	}
	f.drained(c)
}

// testMaxAttempts: a message whose every run fails is run exactly
// MaxAttempts times, then one copy goes to the dead-letter topic and the
// original is acked; no effect is committed.
func testMaxAttempts(f *fixture) {
	f.setBehave(func(context.Context, string, int) error { return errFail })
	dead := f.collect(f.dead)
	c := f.startConsumer(modeTx)
	id := watermill.NewUUID()
	f.publish(id, order(id))
	f.waitFor("the message dead-lettered and acked", func() (bool, string) {
		n, _ := dead.count(id)
		return n >= 1 && f.count(f.acks, id) >= 1, fmt.Sprintf("%s, %d dead-letter copies", f.state(id), n)
	})
	time.Sleep(settleGrace)
	n, reason := dead.count(id)
	if runs := f.count(f.runs, id); runs != maxAttempts {
		f.t.Errorf("a message that always fails ran %d times, want MaxAttempts = %d (%s)", runs, maxAttempts, f.state(id))
	}
	if n != 1 {
		f.t.Errorf("%d dead-letter copies, want 1", n)
	}
	if reason == "" {
		f.t.Error("the dead-letter copy carries no settle_reason")
	}
	if fx := f.effects(id); fx != 0 {
		f.t.Errorf("%d effects of a message whose runs all failed, want 0 (rolled back)", fx)
	}
	f.drained(c)
}

// testPoison: a payload the handler's type cannot decode never reaches the
// handler; one copy goes to the poison topic and the original is acked.
func testPoison(f *fixture) {
	poison := f.collect(f.poison)
	c := f.startConsumer(modeTx)
	id := watermill.NewUUID()
	f.publish(id, []byte("\x00{not json"))
	f.waitFor("the message poisoned and acked", func() (bool, string) {
		n, _ := poison.count(id)
		return n >= 1 && f.count(f.acks, id) >= 1, fmt.Sprintf("%s, %d poison copies", f.state(id), n)
	})
	time.Sleep(settleGrace)
	if runs := f.count(f.runs, id); runs != 0 {
		f.t.Errorf("an undecodable message ran the handler %d times, want 0", runs)
	}
	if n, _ := poison.count(id); n != 1 {
		f.t.Errorf("%d poison copies, want 1", n)
	}
	f.drained(c)
}

// testBusyKey: a message whose key is claimed elsewhere (a live claim of
// another worker) is deferred: not run, not acked, delivered again; once
// the claim is released it is done, once.
func testBusyKey(f *fixture) {
	id := watermill.NewUUID()
	ctx := context.Background()
	claim, err := f.store.Claim(ctx, dedupe.ScopedKey(handlerName, id), 5*time.Minute)
	if err != nil || claim.Result != dedupe.Acquired {
		f.t.Fatalf("brokertest: hold the key elsewhere: %v, %v", claim.Result, err)
	}
	c := f.startConsumer(modeTx)
	f.publish(id, order(id))
	f.waitFor("the message deferred twice", func() (bool, string) { return f.count(f.nacks, id) >= 2, f.state(id) })
	if runs, acks := f.count(f.runs, id), f.count(f.acks, id); runs != 0 || acks != 0 {
		f.t.Fatalf("a message whose key is held elsewhere: %d runs, %d acks; want 0 and 0", runs, acks)
	}
	if err := f.store.Release(ctx, claim); err != nil {
		f.t.Fatalf("brokertest: release the key: %v", err)
	}
	f.waitFor("the message done after the release", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	time.Sleep(settleGrace)
	if runs, fx := f.count(f.runs, id), f.effects(id); runs != 1 || fx != 1 {
		f.t.Errorf("after the release: %d runs, %d effects; want 1 and 1 (%s)", runs, fx, f.state(id))
	}
	f.drained(c)
}

// testBacklogDrained: many messages on two consumers, a third of them
// failing their first run, are all done once and nothing is left at the
// broker.
func testBacklogDrained(f *fixture) {
	f.setBehave(func(_ context.Context, id string, run int) error {
		if run == 1 && id[len(id)-1]%3 == 0 {
			return errFail
		}
		return nil
	})
	c1, c2 := f.startConsumer(modeTx), f.startConsumer(modeTx)
	const n = 30
	ids := make([]string, n)
	for i := range ids {
		ids[i] = watermill.NewUUID()
		f.publish(ids[i], order(ids[i]))
	}
	for _, id := range ids {
		f.waitFor("every message done", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	}
	for _, id := range ids {
		if fx := f.effects(id); fx != 1 {
			f.t.Errorf("message %s: %d effects, want 1 (%s)", id, fx, f.state(id))
		}
	}
	f.drained(c1, c2)
}

// testStopMidHandler: a consumer stopped (its router closed, which closes
// its subscriber) while its handler runs, the run then failing, leaves the
// message with the broker: a second consumer gets it and does the work,
// once. A subscriber that acks what it hands out when it closes, done or
// not (nats.go without ManualAck), loses it here.
func testStopMidHandler(f *fixture) {
	if f.h.InProcess {
		f.t.Skip("brokertest: Harness.InProcess: a message in flight when its subscription closes is gone with it")
	}
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	f.setBehave(func(ctx context.Context, _ string, run int) error {
		if run > 1 {
			return nil
		}
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-ctx.Done():
		}
		return errFail
	})
	c1 := f.startConsumer(modeTx)
	id := watermill.NewUUID()
	f.publish(id, order(id))
	select {
	case <-entered:
	case <-time.After(wait):
		f.t.Fatalf("brokertest: the handler did not start: %s", f.state(id))
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		c1.stop(f.t)
	}()
	time.Sleep(500 * time.Millisecond) // the subscriber is closed while the handler runs
	close(release)
	<-stopped
	c2 := f.startConsumer(modeTx)
	f.waitFor("a second consumer done with the message", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	time.Sleep(settleGrace)
	if runs, fx := f.count(f.runs, id), f.effects(id); runs != 2 || fx != 1 {
		f.t.Errorf("after a stop mid-handler: %d runs, %d effects; want 2 and 1 (%s)", runs, fx, f.state(id))
	}
	f.drained(c2)
}
