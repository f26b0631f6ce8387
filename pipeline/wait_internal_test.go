package pipeline

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
)

// A leader's timer is set early by the batcher's learned timer lateness, so
// that the estimate must follow the lateness seen, stay within half of the
// wait, and fall again when timers fire on time.
func TestWakeLateFollowsTheTimers(t *testing.T) {
	const wait = 2 * time.Millisecond
	var avg time.Duration
	for range 40 {
		avg = wakeLate(avg, 300*time.Microsecond, wait)
	}
	if avg < 290*time.Microsecond || avg > 300*time.Microsecond {
		t.Fatalf("after 40 timers 300µs late the estimate is %v, want about 300µs", avg)
	}
	for range 40 {
		avg = wakeLate(avg, time.Nanosecond, wait)
	}
	if avg > 10*time.Microsecond {
		t.Fatalf("after 40 timers on time the estimate is %v, want about 0", avg)
	}
	for range 40 {
		avg = wakeLate(avg, 50*time.Millisecond, wait)
	}
	if avg != wait/2 {
		t.Fatalf("timers 50ms late: the estimate is %v, want it capped at half the wait, %v", avg, wait/2)
	}
	// One late timer among punctual ones moves it by an eighth.
	if got := wakeLate(0, 800*time.Microsecond, wait); got != 100*time.Microsecond {
		t.Fatalf("one timer 800µs late: %v, want 100µs", got)
	}
}

// When BEGIN took most of the wait, the timer is set for what is left, not
// for less than nothing: it must fire, so that its lateness is learned and a
// high estimate comes down again.
func TestTimerForLeavesATimerToLearnFrom(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct{ rest, early, want time.Duration }{
		{2 * ms, 300 * time.Microsecond, 1700 * time.Microsecond},
		{ms / 2, ms, ms / 2}, // BEGIN took 1.5ms of 2ms, the estimate is 1ms
		{0, ms, 0},           // nothing left: no timer
		{2 * ms, 0, 2 * ms},
	} {
		if got := timerFor(c.rest, c.early); got != c.want {
			t.Errorf("timerFor(%v, %v) = %v, want %v", c.rest, c.early, got, c.want)
		}
	}
}

// fakeTxn is a transaction that claims every key and records its calls.
type fakeTxn struct{ f *fakeDB }

type fakeDB struct {
	mu        sync.Mutex
	begins    int
	failFirst bool // the first BEGIN fails
	beginTook time.Duration
	committed []string
}

func (d *fakeDB) begin(context.Context) (txn, error) {
	time.Sleep(d.beginTook)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.begins++
	if d.failFirst && d.begins == 1 {
		return nil, errors.New("connection refused")
	}
	return &fakeTxn{f: d}, nil
}

func (t *fakeTxn) claims() claimer                                     { return t }
func (t *fakeTxn) hold(context.Context) error                          { return nil }
func (t *fakeTxn) confirm(context.Context) error                       { return nil }
func (t *fakeTxn) commit(context.Context) error                        { return nil }
func (t *fakeTxn) rollback(context.Context) error                      { return nil }
func (t *fakeTxn) probe(context.Context) error                         { return nil }
func (t *fakeTxn) setLocal(context.Context, string) error              { return nil }
func (t *fakeTxn) callBatch(context.Context, []*message.Message) error { return nil }
func (t *fakeTxn) call(_ context.Context, msg *message.Message) error {
	t.f.mu.Lock()
	t.f.committed = append(t.f.committed, msg.UUID)
	t.f.mu.Unlock()
	return nil
}
func (t *fakeTxn) ClaimConfirmed(_ context.Context, key string) (dedupe.Claim, error) {
	return dedupe.Claim{Key: key, Result: dedupe.Acquired, Attempt: 1}, nil
}
func (t *fakeTxn) ClaimConfirmedAll(_ context.Context, keys []string) ([]dedupe.Claim, error) {
	cs := make([]dedupe.Claim, len(keys))
	for i, k := range keys {
		cs[i] = dedupe.Claim{Key: k, Result: dedupe.Acquired, Attempt: 1}
	}
	return cs, nil
}

func fakeBatcher(d *fakeDB, wait time.Duration) *batcher {
	return newBatcher(txFlow{begin: d.begin, beginEarly: true,
		batch: BatchConfig{MaxSize: 8, MaxWait: wait}, busyDelay: time.Millisecond})
}

// A BEGIN that failed when the batch's first delivery arrived is tried again
// when the batch starts: the database may answer by then, and the batch
// must not be deferred for an error that is no longer true.
func TestEarlyBeginFailureIsTriedAgain(t *testing.T) {
	d := &fakeDB{failFirst: true}
	b := fakeBatcher(d, 5*time.Millisecond)
	if err := b.handle(message.NewMessage("m-1", nil)); err != nil {
		t.Fatalf("handle: %v, want the batch run on a second BEGIN", err)
	}
	if d.begins != 2 || len(d.committed) != 1 {
		t.Fatalf("%d BEGINs, calls %v; want 2 BEGINs and m-1 run once", d.begins, d.committed)
	}
}

// A high estimate of the timers' lateness comes down again even when BEGIN
// takes most of the wait (the helper's case: BEGIN 11ms of a 20ms wait, the
// estimate at its cap of 10ms).
func TestLateEstimateComesDownWhenBeginIsSlow(t *testing.T) {
	d := &fakeDB{beginTook: 11 * time.Millisecond}
	b := fakeBatcher(d, 20*time.Millisecond)
	b.late = 10 * time.Millisecond
	for i := range 20 {
		if err := b.handle(message.NewMessage(fmt.Sprint("m-", i), nil)); err != nil {
			t.Fatal(err)
		}
	}
	b.mu.Lock()
	late := b.late
	b.mu.Unlock()
	if late > 5*time.Millisecond {
		t.Fatalf("estimate %v after 20 batches, want it well below the 10ms it started at", late)
	}
}
