package pipeline

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
)

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
func (t *fakeTxn) Refuse(context.Context, string) error { return nil }

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
