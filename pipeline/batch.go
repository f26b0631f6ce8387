package pipeline

import (
	"context"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
)

// BatchConfig turns on group commit for a transactional handler: deliveries
// of the handler that are in flight at the same time (its competing
// subscriptions, see Config.Concurrency) share one database transaction, so
// that one commit carries many messages. Commits are what a transactional
// handler pays for; a commit per batch instead of one per message is how
// exactly-once gets faster than the one-commit-per-message floor.
//
// Each message keeps its own settlement. The batch's keys are written as
// confirmed inside the transaction in one statement (as with OneStatement,
// see dedupe.SQLStore.ClaimConfirmedAll), every handler
// call of the batch runs in it, in the order of the keys (so that two
// batches claiming the same keys lock them in the same order instead of
// deadlocking), and every delivery is acked only after the commit. A message whose handler fails (or panics)
// is taken out: the transaction is rolled back and the rest of the batch is
// run again without it, so the others still commit and only that message is
// retried, dead-lettered or poisoned. The handler's writes must therefore be
// in the transaction only (which is true of any transactional handler): a
// run that was rolled back leaves nothing.
//
// The price is latency: the first delivery of a batch waits up to MaxWait
// for others to join.
type BatchConfig struct {
	// MaxSize is the most deliveries one transaction carries. 0 or 1 means
	// no batching. pipeline's HandleTx caps it at Config.Concurrency, since
	// no more deliveries of the handler can be in flight; a batch that has
	// them all starts at once.
	MaxSize int
	// MaxWait is how long the first delivery of a batch waits for others
	// before the batch starts. Defaults to 2ms when 0; a negative value
	// means no wait: a batch starts with whatever has already arrived.
	MaxWait time.Duration
}

// DefaultBatchWait is BatchConfig.MaxWait when it is not set.
const DefaultBatchWait = 2 * time.Millisecond

func (c BatchConfig) enabled() bool { return c.MaxSize > 1 }

// batcher gathers the deliveries of one transactional handler into batches.
// It has no goroutine of its own: the first delivery of a batch leads it,
// running the whole batch on its own goroutine, and the others wait for
// their result.
type batcher struct {
	f    txFlow
	wait time.Duration

	mu   sync.Mutex
	open *batch // the batch deliveries join now; nil when none is open
}

type batch struct {
	jobs []*job
	full chan struct{} // closed when jobs reaches MaxSize
}

// job is one delivery in a batch.
type job struct {
	ctx  context.Context
	msg  *message.Message
	key  string
	done chan error // the delivery's result, sent once

	// Per run of the batch:
	claimed bool  // the key was written as confirmed in this run
	err     error // a result decided without running fn (busy)
}

func newBatcher(f txFlow) *batcher {
	wait := f.batch.MaxWait
	if wait == 0 {
		wait = DefaultBatchWait
	}
	return &batcher{f: f, wait: wait}
}

// handle settles msg as part of a batch and returns its result.
func (b *batcher) handle(msg *message.Message) error {
	j := &job{ctx: msg.Context(), msg: msg, done: make(chan error, 1)}
	b.mu.Lock()
	bt := b.open
	leader := bt == nil
	if leader {
		bt = &batch{full: make(chan struct{})}
		b.open = bt
	}
	bt.jobs = append(bt.jobs, j)
	if len(bt.jobs) >= b.f.batch.MaxSize {
		b.open = nil
		close(bt.full)
	}
	b.mu.Unlock()

	if leader {
		if b.wait > 0 {
			t := time.NewTimer(b.wait)
			select {
			case <-bt.full:
			case <-t.C:
			}
			t.Stop()
		}
		b.mu.Lock()
		if b.open == bt {
			b.open = nil
		}
		jobs := bt.jobs
		b.mu.Unlock()
		b.run(jobs)
	}
	return <-j.done
}

// run settles a closed batch and answers every job.
func (b *batcher) run(jobs []*job) {
	// The batch belongs to all its deliveries: a router shutdown cancelling
	// the leader's message must not abandon the others halfway.
	ctx := context.WithoutCancel(jobs[0].ctx)

	// Keys first: a job whose key cannot be derived fails alone, and a key
	// that appears twice in one batch (the same message delivered twice at
	// once) is settled by its first job; the others follow its fate.
	var pending []*job
	first := map[string]*job{}
	for _, j := range jobs {
		key, err := dedupe.MessageKey(j.msg, b.f.key, b.f.scope)
		if err != nil {
			j.done <- fmt.Errorf("pipeline: key of message %s: %w", j.msg.UUID, err)
			continue
		}
		j.key = key
		if _, seen := first[key]; seen {
			continue
		}
		first[key] = j
		pending = append(pending, j)
	}
	slices.SortFunc(pending, func(a, b *job) int { return strings.Compare(a.key, b.key) })

	// Optimistically run everything in one transaction; when a job fails,
	// take it out and run the rest again. At most len(pending) runs.
	result := make(map[string]error, len(pending))
	for len(pending) > 0 {
		failed, err := b.runOnce(ctx, pending)
		if failed < 0 {
			for _, j := range pending {
				switch {
				case err != nil: // begin or commit failed: nothing landed
					result[j.key] = err
				default:
					result[j.key] = j.err
				}
			}
			break
		}
		result[pending[failed].key] = err
		pending = append(pending[:failed:failed], pending[failed+1:]...)
	}
	for _, j := range jobs {
		if j.key == "" {
			continue // answered above
		}
		err, ok := result[j.key]
		if first[j.key] != j {
			ok = false
		}
		switch {
		case ok:
			j.done <- err
		case result[j.key] == nil:
			// A twin of a job that settled (done, or a duplicate already):
			// the key is confirmed, this delivery is a duplicate.
			settle.SettlementFromContext(j.ctx).SetOutcome(settle.Duplicate)
			j.done <- nil
		default:
			// Its twin failed and left nothing durable: this delivery comes
			// back later and finds the key as its twin left it.
			settle.SettlementFromContext(j.ctx).SetOutcome(settle.Deferred)
			j.done <- fmt.Errorf("%w (message %s, delivered twice in one batch)", dedupe.ErrBusy, j.msg.UUID)
		}
	}
}

// runOnce runs jobs in one transaction. It returns the index of a job that
// failed, with its error (the transaction was rolled back), or -1 with the
// error of begin or commit (nil when the batch committed).
func (b *batcher) runOnce(ctx context.Context, jobs []*job) (failed int, err error) {
	tx, err := b.f.begin(ctx)
	if err != nil {
		return -1, fmt.Errorf("pipeline: begin batch: %w", err)
	}
	defer func() { _ = tx.rollback(ctx) }() // after commit: a no-op
	keys := make([]string, len(jobs))
	for i, j := range jobs {
		keys[i] = j.key
		j.claimed, j.err = false, nil
	}
	// All keys in one statement; a batch whose claims fail fails whole.
	claims, err := tx.claims().ClaimConfirmedAll(ctx, keys)
	if err != nil {
		return -1, err
	}
	for i, j := range jobs {
		done, err := claimResult(j.ctx, claims[i], j.msg)
		switch {
		case err != nil: // busy: nothing written for it, the others go on
			j.err = err
			continue
		case done:
			continue // a duplicate: acked with the batch
		}
		j.claimed = true
		if err := b.call(j, tx); err != nil {
			return i, err
		}
	}
	if err := tx.commit(ctx); err != nil {
		return -1, fmt.Errorf("pipeline: commit batch: %w", err)
	}
	return -1, nil
}

// call runs fn for one job, turning a panic into that job's error: the
// panic belongs to one message, not to the batch or the leader's goroutine.
func (b *batcher) call(j *job, tx txn) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &HandlerPanic{Value: p, Stack: debug.Stack()}
		}
	}()
	return tx.call(j.ctx, j.msg)
}

// HandlerPanic is the error of a batched handler call that panicked. Only
// that message fails; the rest of its batch commits.
type HandlerPanic struct {
	Value any
	Stack []byte
}

func (p *HandlerPanic) Error() string { return fmt.Sprintf("pipeline: handler panicked: %v", p.Value) }
