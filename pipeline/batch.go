package pipeline

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settlement"
	"github.com/settle-go/settle/middleware"
)

// BatchConfig turns on group commit for a transactional handler: deliveries
// of the handler that are in flight at the same time (its competing
// subscriptions, see Config.Concurrency, or the deliveries in flight on one
// subscription of a subscriber such as amqpsub's) share one database transaction, so
// that one commit carries many messages. Commits are what a transactional
// handler pays for; a commit per batch instead of one per message is how
// exactly-once gets faster than the one-commit-per-message floor.
//
// Each message keeps its own settlement. The batch's keys are written as
// confirmed inside the transaction in one statement (as with OneStatement,
// see dedupe.SQLStore.ClaimConfirmedAll), every handler
// call of the batch runs in it, in the order of the keys (so that two
// batches claiming the same keys lock them in the same order instead of
// deadlocking), the outbox messages of all its calls are written together
// just before the commit (one multi-row insert per run of messages to one
// topic, instead of one insert per call; after the calls have returned,
// so under the batch's context, with only the values of the context a call
// gave a message), and every delivery is acked only after the commit. A
// message whose handler fails (or panics) is taken out: the transaction is
// rolled back and the rest of the batch is run again without it, so the
// others still commit and only that message is retried, dead-lettered or
// poisoned. The handler's writes must therefore be
// in the transaction only (which is true of any transactional handler): a
// run that was rolled back leaves nothing. Since the outbox rows are
// written at the end, a handler does not see its own outbox rows in the
// transaction, and an outbox row that cannot be written fails the run
// without naming its message: the batch is then split, as for a batch
// function's failure (see BatchTxFunc), until that message is alone. So is
// a commit that fails (a constraint checked only at the commit). A run
// whose transaction loses its connection (whichever statement met the loss)
// is no message's failure: the same deliveries run again in a new
// transaction after BusyDelay, up to three times, and are then deferred, no
// attempt spent (see NewTxHandler). A delivery that the broker's count
// leaves with no attempt and whose key is not confirmed does not run: its
// key is written as refused in the batch's transaction, and it is
// dead-lettered after the commit; a delivery that finds its key refused is
// dead-lettered without a run (see TxConfig.OneStatement).
//
// Behind the dedupe middleware (which pipeline does not put in front of a
// batch), a batch takes the middleware's claim of each message instead of
// claiming its key, and confirms it in the transaction, one statement per
// message: correct, but most of what batching saves is lost.
//
// The price is latency: the first delivery of a batch waits up to MaxWait
// for others to join.
type BatchConfig struct {
	// MaxSize is the most deliveries one transaction carries. 0 or 1 means
	// no batching. pipeline's HandleTx caps it at the deliveries the handler
	// can have in flight (Config.Concurrency, times the InFlight of a
	// subscriber such as amqpsub's), since no more can be; a batch that has
	// them all starts at once.
	MaxSize int
	// MaxWait is how long the first delivery of a batch waits for others
	// before the batch starts. Defaults to 2ms when 0; a negative value
	// means no wait: a batch starts with whatever has already arrived.
	// On PostgreSQL and MariaDB/MySQL the batch's transaction begins when
	// its first delivery arrives, so that BEGIN's round trip to the server
	// is part of the wait, not added to it; a batch starts once BEGIN has
	// returned, even if that took longer than MaxWait. On SQLite it begins
	// when the batch starts.
	MaxWait time.Duration
}

// defaultBatchWait is BatchConfig.MaxWait when it is not set.
const defaultBatchWait = 2 * time.Millisecond

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
	done chan error // the delivery's result, sent once (answer)
	sent bool       // done has its result; only the batch's leader sets it

	held bool // the dedupe middleware in front claimed the key: the batch confirms its claim
	last bool // no attempt left (the retry middleware's count): the claim only says whether the key is confirmed

	// Per run of the batch:
	claimed bool  // the key was written as confirmed (or held) in this run
	err     error // a result decided without running fn (busy)
}

// answer gives the job its result.
func (j *job) answer(err error) {
	j.done <- err
	j.sent = true
}

func newBatcher(f txFlow) *batcher {
	wait := f.batch.MaxWait
	if wait == 0 {
		wait = defaultBatchWait
	}
	return &batcher{f: f, wait: wait}
}

// handle settles msg as part of a batch and returns its result.
func (b *batcher) handle(msg *message.Message) error {
	if forAnother(msg) {
		return nil // not in a batch: nothing to run
	}
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
		// The batch's transaction begins while the others join: BEGIN is
		// a round trip to the server that would otherwise come after the
		// wait (not on SQLite, see txFlow.beginEarly).
		arrived := time.Now()
		var pre txn // nil when not begun early, or when BEGIN failed (it is tried again)
		if b.f.beginEarly {
			pre, _ = b.f.begin(context.WithoutCancel(j.ctx))
		}
		// A plain timer. Setting it early by the batcher's learned timer
		// lateness (at most half of MaxWait, 0.2-0.3 ms on an idle machine)
		// was measured against it and removed: go run ./bench -only batch
		// -quick -runs 1, both builds in one session, 2026-12-02, load
		// average 14-28 on 2 cores: the latency batching added at p50 over
		// the per-message handler ranged from -44 to +35 ms over the 12
		// cells with it, -45 to +43 ms without: noise a hundred times the
		// correction.
		if rest := b.wait - time.Since(arrived); rest > 0 {
			t := time.NewTimer(rest)
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
		b.run(jobs, pre)
	}
	err := <-j.done
	if errors.Is(err, dedupe.ErrBusy) || errors.Is(err, dedupe.ErrUnavailable) {
		// Deferred: wait on this delivery's own goroutine, not the batch's.
		settlement.Sleep(j.ctx, b.f.busyDelay)
	}
	return err
}

// take returns the transaction for a run: the one begun early for the first
// run (pre is then used up), a new one for the others, and for the first
// when its early BEGIN failed (the batch starts later, and the database may
// answer by then).
func (b *batcher) take(ctx context.Context, pre *txn) (txn, error) {
	if tx := *pre; tx != nil {
		*pre = nil
		return tx, nil
	}
	return b.f.begin(ctx)
}

// run settles a closed batch and answers every job. pre is the transaction
// begun for its first run, or nil.
func (b *batcher) run(jobs []*job, pre txn) {
	// The batch belongs to all its deliveries: a router shutdown cancelling
	// the leader's message must not abandon the others halfway.
	ctx := context.WithoutCancel(jobs[0].ctx)
	defer func() {
		if pre != nil {
			// No run used it: every key failed.
			_ = pre.rollback(ctx)
		}
	}()
	defer func() {
		// A panic here (none is expected: handler and key panics are
		// each their message's error) must not leave the deliveries of
		// the batch waiting for an answer that never comes.
		if p := recover(); p != nil {
			err := &middleware.PanicError{Value: p, Stack: debug.Stack()}
			for _, j := range jobs {
				if !j.sent {
					j.answer(err)
				}
			}
		}
	}()

	// Keys first: a job whose key cannot be derived fails alone, and a key
	// that appears twice in one batch (the same message delivered twice at
	// once) is settled by its first job; the others follow its fate.
	var pending []*job
	first := map[string]*job{}
	for _, j := range jobs {
		var key string
		var err error
		if c, ok := dedupe.ClaimFromContext(j.ctx); ok {
			// Behind the dedupe middleware: its claim is the key's, taken
			// outside the transaction, and confirmed inside it.
			j.held, key = true, c.Key
		} else {
			j.last = settlement.FromContext(j.ctx).NoAttemptLeft()
			key, err = b.keyOf(j)
		}
		if err != nil {
			j.answer(fmt.Errorf("pipeline: key of message %s: %w", j.msg.UUID, err))
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

	result := make(map[string]error, len(pending))
	b.settle(ctx, pending, result, &pre)
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
			j.answer(err)
		case result[j.key] == nil:
			// A twin of a job that settled (done, or a duplicate already):
			// the key is confirmed, this delivery is a duplicate.
			settlement.FromContext(j.ctx).SetOutcome(settlement.Duplicate)
			j.answer(nil)
		default:
			// Its twin failed and left nothing durable: this delivery comes
			// back later and finds the key as its twin left it.
			settlement.FromContext(j.ctx).Defer()
			j.answer(fmt.Errorf("%w (message %s, delivered twice in one batch)", dedupe.ErrBusy, j.msg.UUID))
		}
	}
}

// settle runs pending (jobs of distinct keys) and records each one's result.
// Optimistically everything runs in one transaction; when a job fails it is
// taken out and the rest run again. A batch function that fails without
// naming its message (see MessageFailed) fails the whole run; then the batch
// is split in two and each half settled on its own, until the message that
// fails is alone.
func (b *batcher) settle(ctx context.Context, pending []*job, result map[string]error, pre *txn) {
	lost := 0 // runs that lost their connection
	for len(pending) > 0 {
		failed, err := b.runOnce(ctx, pending, pre)
		switch {
		case failed == runCommitted:
			for _, j := range pending {
				result[j.key] = j.err
			}
			return
		case failed == runConnLost:
			// The connection went away under the run (see connTrouble):
			// no message's fault, and nothing landed, or the claims of the
			// next run find the keys confirmed. The same jobs run again on
			// a new connection, and are deferred when it keeps happening.
			if lost < connReruns && settlement.Sleep(ctx, b.f.busyDelay) {
				lost++
				continue
			}
			deferAll(pending, result, withConnLost(err))
			return
		case failed == runNotStarted:
			// Begin or the claims failed: the database is not answering,
			// which is no attempt of any handler.
			deferAll(pending, result, err)
			return
		case failed == runBatchFailed || failed == runCommitFailed:
			// Nothing landed. Which message caused it is not known (a
			// deferred constraint fails at the commit): the batch is split
			// until the one that fails is alone, so that the others commit.
			// A connection lost under the run is runConnLost, never split;
			// a database that does not answer fails the halves' BEGIN or
			// claims, and defers them.
			var ran []*job
			for _, j := range pending {
				if j.claimed {
					ran = append(ran, j)
				}
			}
			if len(ran) == 0 {
				// A commit that failed with no work in it: only duplicates
				// and busy keys, which come back and are decided again.
				deferAll(pending, result, err)
				return
			}
			if len(ran) == 1 {
				failed = slices.Index(pending, ran[0])
				break
			}
			h := len(pending) / 2
			b.settle(ctx, pending[:h], result, pre)
			b.settle(ctx, pending[h:], result, pre)
			return
		}
		result[pending[failed].key] = err
		pending = append(pending[:failed:failed], pending[failed+1:]...)
	}
}

// deferAll defers every job of pending: err, the database's, is no attempt
// of any handler.
func deferAll(pending []*job, result map[string]error, err error) {
	for _, j := range pending {
		settlement.FromContext(j.ctx).Defer()
		result[j.key] = fmt.Errorf("%w: %w", dedupe.ErrUnavailable, err)
	}
}

// Results of runOnce that name no job.
const (
	runCommitted    = -1 // err is nil
	runNotStarted   = -2 // begin or the claims (or the middleware's, held or confirmed) failed: err says why
	runBatchFailed  = -3 // the batch function failed without naming a message
	runCommitFailed = -4 // err says why; nothing landed
	runConnLost     = -5 // the transaction's connection was lost (err says how); the jobs can run again
)

// runOnce runs jobs in one transaction (the one begun early when pre still
// holds it). It returns the index of a job that failed, with its error (the
// transaction was rolled back), or one of the run results above.
func (b *batcher) runOnce(ctx context.Context, jobs []*job, pre *txn) (failed int, err error) {
	tx, err := b.take(ctx, pre)
	if err != nil {
		return runNotStarted, fmt.Errorf("pipeline: begin batch: %w", err)
	}
	defer func() { _ = tx.rollback(ctx) }() // after commit: a no-op
	keys := make([]string, 0, len(jobs))    // of the jobs not held by the middleware
	for _, j := range jobs {
		if !j.held {
			keys = append(keys, j.key)
		}
		j.claimed, j.err = false, nil
		// The outcome a previous run's claim set (deferred for a busy key)
		// is stale: this run's claim decides it again.
		settlement.FromContext(j.ctx).Undecide()
	}
	if ob, ok := tx.(outboxBuffering); ok {
		ob.bufferOutbox()
	}
	// Every claim of the dedupe middleware is held by the transaction before
	// any handler runs, and before any other statement: on SQLite the first
	// hold takes the write lock, after which the middleware's renewals of
	// the others could not land; on PostgreSQL at REPEATABLE READ or
	// SERIALIZABLE the first statement takes the snapshot, and a renewal
	// landing after it would fail the hold of its claim.
	for i, j := range jobs {
		if j.held {
			if failed, err := heldFailed(i, tx.hold(j.ctx)); err != nil {
				return failed, err
			}
		}
	}
	// All keys in one statement; a batch whose claims fail fails whole.
	var claims []dedupe.Claim
	if len(keys) > 0 {
		if claims, err = tx.claims().ClaimConfirmedAll(ctx, keys); err != nil {
			if lostOnce(err) {
				return runConnLost, err
			}
			return runNotStarted, err
		}
	}
	// A job with no attempt left (the retry middleware's count) whose key
	// this run acquired is refused, its function not run: its key is
	// turned into a refused one in this transaction, which commits the
	// refusal with the rest of the batch, before the job's delivery is
	// dead-lettered (see refuseDurably). One whose key is confirmed is a
	// duplicate, as any.
	refusing := make([]bool, len(claims))
	k := 0
	for _, j := range jobs {
		if j.held {
			continue
		}
		if k++; j.last && claims[k-1].Result == dedupe.Acquired {
			if err := tx.claims().Refuse(ctx, j.key); err != nil {
				if lostOnce(err) {
					return runConnLost, err
				}
				return runNotStarted, fmt.Errorf("pipeline: refuse: %w", err)
			}
			refusing[k-1] = true
		}
	}
	var ran []int // indexes of the jobs the batch function gets
	k = 0
	for i, j := range jobs {
		if !j.held {
			c := claims[k]
			if k++; refusing[k-1] {
				j.err = refuse(j.ctx, j.msg, "key not confirmed, no attempt left")
				continue
			}
			done, err := claimResult(j.ctx, c, j.msg)
			switch {
			case err != nil: // busy or refused: nothing run for it, the others go on
				j.err = err
				continue
			case done:
				continue // a duplicate: acked with the batch
			}
		}
		j.claimed = true
		if b.f.batchHandler {
			ran = append(ran, i)
			continue
		}
		if err := b.call(j, tx); err != nil {
			if handlerLostConnection(ctx, tx, err) {
				return runConnLost, err // the whole transaction went with it
			}
			return i, err
		}
	}
	if b.f.batchHandler && len(ran) > 0 {
		msgs := make([]*message.Message, len(ran))
		for k, i := range ran {
			msgs[k] = jobs[i].msg
		}
		if err := b.callBatch(ctx, tx, msgs); err != nil {
			if handlerLostConnection(ctx, tx, err) {
				return runConnLost, err
			}
			var me *messageError
			if errors.As(err, &me) && me.Index >= 0 && me.Index < len(ran) {
				if me.Err == nil {
					// Named, but with no error: it failed all the same (the
					// run is rolled back), and must not be taken as done.
					return ran[me.Index], fmt.Errorf("pipeline: the batch function named message %s as failed with a nil error", jobs[ran[me.Index]].msg.UUID)
				}
				return ran[me.Index], me.Err
			}
			return runBatchFailed, err
		}
	}
	if ob, ok := tx.(outboxBuffering); ok {
		// The outbox messages of the whole run, in one insert per run of
		// messages to one topic. Which message's row failed is not known:
		// the batch is split like a batch function's unnamed failure.
		if err := ob.flushOutbox(ctx); err != nil {
			err = fmt.Errorf("pipeline: outbox of the batch: %w", err)
			switch {
			case errors.Is(err, ErrCallTimeout):
				return runNotStarted, err // the database does not answer
			case connTrouble(err):
				return runConnLost, err
			}
			return runBatchFailed, err
		}
	}
	// The claims of the dedupe middleware in front, confirmed last (each
	// confirmation stops its claim's renewal), in the commit.
	held := false
	for i, j := range jobs {
		if j.held && j.claimed {
			held = true
			err := tx.confirm(j.ctx)
			if !claimsOwnFailure(err) && lostOnce(err) {
				return runConnLost, err // nothing landed; the claims are still the jobs'
			}
			if failed, err := heldFailed(i, err); err != nil {
				return failed, err
			}
		}
	}
	if err := tx.commit(ctx); err != nil {
		err = fmt.Errorf("pipeline: commit batch: %w", err)
		switch {
		case errors.Is(err, ErrCallTimeout):
			// The database did not answer (whether it committed is not
			// known: the keys' rows decide when the deliveries come back).
			return runNotStarted, err
		case connTrouble(err) && !held:
			// Not known either; the claims of the next run find the keys
			// confirmed if it committed.
			return runConnLost, err
		case connTrouble(err):
			// The middleware's claims would not say (their confirmation
			// fails either way): the deliveries are deferred, and the
			// claims of their redeliveries decide.
			return runNotStarted, withConnLost(err)
		}
		return runCommitFailed, err
	}
	if b.f.committed != nil {
		b.f.committed()
	}
	return runCommitted, nil
}

// heldFailed is what runOnce returns when holding or confirming the
// middleware's claim of job i failed with err: that job alone when the
// failure is its claim's own (see claimsOwnFailure), the whole run
// otherwise, as for claims that fail (the store is not answering, which is
// no attempt of any handler). Nil err: nothing failed.
func heldFailed(i int, err error) (int, error) {
	switch {
	case err == nil:
		return 0, nil
	case claimsOwnFailure(err):
		return i, err
	}
	return runNotStarted, err
}

// outboxBuffering is implemented by a txn that can hold back the outbox
// messages its handler calls publish and write them all at once: a batch's
// messages in one multi-row insert instead of one insert per handler call.
// The batcher turns it on for each run of a batch and flushes before the
// commit; a run that is rolled back drops what it held with its txn.
type outboxBuffering interface {
	bufferOutbox()
	flushOutbox(ctx context.Context) error
}

// publishBuffer is the outbox publisher of a batch's run: it keeps what is
// published, in order, and hands it to the outbox publisher at flush, one
// Publish (one multi-row insert) per run of messages to the same topic, so
// that the rows keep the order in which they were published.
type publishBuffer struct {
	next message.Publisher

	mu      sync.Mutex
	pending []published
}

type published struct {
	topic string
	msgs  []*message.Message
}

func (b *publishBuffer) Publish(topic string, msgs ...*message.Message) error {
	if topic == "" {
		return errors.New("pipeline: outbox publish: empty destination topic")
	}
	if len(msgs) == 0 {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if n := len(b.pending); n > 0 && b.pending[n-1].topic == topic {
		b.pending[n-1].msgs = append(b.pending[n-1].msgs, msgs...)
	} else {
		b.pending = append(b.pending, published{topic: topic, msgs: slices.Clone(msgs)})
	}
	return nil
}

// flush writes what is held through the outbox publisher, under ctx, the
// batch's: the handler calls that published have returned, and the context
// a handler gave a message (m.SetContext) may be cancelled by now (a handler
// that derived it and deferred its cancel). Each message is written under
// settleContext(ctx, its context), then given its context back.
func (b *publishBuffer) flush(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.pending {
		if err := publishUnder(ctx, b.next, p.topic, p.msgs); err != nil {
			return err
		}
	}
	b.pending = nil
	return nil
}

// publishUnder publishes msgs on out with each message's context replaced,
// for the call, by settleContext(ctx, its own).
func publishUnder(ctx context.Context, out message.Publisher, topic string, msgs []*message.Message) error {
	own := make([]context.Context, len(msgs))
	for i, m := range msgs {
		if m != nil {
			own[i] = m.Context()
			m.SetContext(settleContext(ctx, own[i]))
		}
	}
	defer func() {
		for i, m := range msgs {
			if m != nil {
				m.SetContext(own[i])
			}
		}
	}()
	return out.Publish(topic, msgs...)
}

// Close does nothing: the buffer lives as long as its transaction.
func (b *publishBuffer) Close() error { return nil }

// settleContext returns a context for work that settle does after a handler
// has returned, on behalf of what the handler left with it (an outbox
// message): the values of the handler's context (its trace context above
// all, so that the outbox row continues the handler's trace) and nothing the
// handler can cancel or let expire. ctx, settle's, is the batch's context,
// which no one cancels (see batcher.run): its cancellation has nothing to
// add.
func settleContext(ctx, values context.Context) context.Context {
	if values == nil || values == ctx {
		return ctx
	}
	return context.WithoutCancel(values)
}

// detachProduced is the innermost middleware of a producing handler: the
// messages the handler returns are published after it has returned (by the
// dedupe middleware, or by publishOutput when there is no store), so each one's
// context becomes context.WithoutCancel of the context the handler gave it:
// its values (the trace context) stay, its cancellation does not. A handler
// that derived a context, gave it to its output and deferred the cancel
// would otherwise have every publish refused (watermill-amqp publishes under
// the message's context) and its delivery nacked again and again.
func detachProduced(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		for _, m := range out {
			if m != nil && m.Context().Done() != nil {
				m.SetContext(context.WithoutCancel(m.Context()))
			}
		}
		return out, err
	}
}

// keyOf derives the job's key, turning a panic of the key or scope function
// into that job's error, as for a handler call.
func (b *batcher) keyOf(j *job) (key string, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &middleware.PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	key, err = dedupe.MessageKey(j.msg, b.f.key, b.f.scope)
	if err == nil {
		recordKey(j.ctx, j.msg, b.f.key)
	}
	return key, err
}

// call runs fn for one job, turning a panic into that job's error: the
// panic belongs to one message, not to the batch or the leader's goroutine.
func (b *batcher) call(j *job, tx txn) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &middleware.PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return tx.call(j.ctx, j.msg)
}

// callBatch runs the batch function, turning a panic into the batch's
// error, which splits the batch like any other failure.
func (b *batcher) callBatch(ctx context.Context, tx txn, msgs []*message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &middleware.PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return tx.callBatch(ctx, msgs)
}

// BatchTxFunc handles a batch of messages in one database transaction: for
// bulk inserts, COPY, or one call of an API per batch. It does its writes on
// tx and publishes on out, the outbox bound to tx (nil when TxConfig.Outbox
// is nil; what is published on it is written in one insert just before the
// commit); it must not commit or roll back tx. msgs holds only messages whose
// work is not done yet: duplicates of earlier deliveries, and keys held by
// another worker, were filtered out before. ctx belongs to the batch; each
// message has its own context too. The outbox insert runs after fn has
// returned, under the batch's context: a context fn derives, gives to the
// messages it publishes (SetContext) and cancels on return lends them its
// values (their trace context) and nothing else.
//
// When it fails, no message of the batch is done. An error of the
// transaction's connection going away (found dead too) is no message's: the
// batch runs again, as BatchConfig says. If the error names the
// message that caused it (MessageFailed), that message alone is settled with
// the error (retried, dead-lettered, or poisoned when the error is permanent)
// and the rest of the batch runs again without it. Any other error, or a
// panic, splits the batch in halves that run on their own, until the message
// that fails is alone.
//
// On pgx (sqldb.Pgx) the function can send the batch's statements in one
// round trip (tx.SendBatch with a pgx.Batch) or copy its rows
// (tx.CopyFrom); an error from one queued statement of a pgx.Batch does not
// say which message it came from unless the function tells (MessageFailed).
// A function that decodes the payloads (Decode) names a message that does
// not decode with MessageFailed and its permanent error, so that message
// alone is poisoned.
type BatchTxFunc[TTx any] func(ctx context.Context, tx TTx, msgs []*message.Message, out message.Publisher) error

// messageError is the error of one message of a batch (MessageFailed).
type messageError struct {
	Index int   // the message's index in the batch function's slice
	Err   error // what is wrong with it
}

func (e *messageError) Error() string {
	return fmt.Sprintf("message %d of the batch: %v", e.Index, e.Err)
}

// Unwrap returns Err.
func (e *messageError) Unwrap() error { return e.Err }

// MessageFailed returns the error a batch function returns when it knows
// which message failed: msgs[index], because of err. Only that message is
// settled with err (an error saying so when err is nil: it is not done);
// the rest of the batch runs again without it.
func MessageFailed(index int, err error) error { return &messageError{Index: index, Err: err} }

// NewBatchTxHandler returns a handler that gathers the deliveries in flight
// into batches (cfg.Batch, whose MaxSize must be at least 2) and runs fn once
// per batch, in one transaction with the batch's dedupe keys (cfg.Store,
// which writes them in one statement) and its outbox messages (cfg.Outbox).
// Each delivery is settled on its own: it is acked after the commit, or
// fails alone as BatchTxFunc says.
func NewBatchTxHandler[TTx any](cfg TxConfig[TTx], fn BatchTxFunc[TTx]) (message.NoPublishHandlerFunc, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if !cfg.Batch.enabled() {
		return nil, fmt.Errorf("pipeline: NewBatchTxHandler needs TxConfig.Batch.MaxSize >= 2, got %d", cfg.Batch.MaxSize)
	}
	if fn == nil {
		return nil, errors.New("pipeline: NewBatchTxHandler: fn is nil")
	}
	return newBatcher(cfg.flow(nil, fn)).handle, nil
}
