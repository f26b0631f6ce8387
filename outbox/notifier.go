package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/sqldb"
)

// notifyTimeout bounds one NOTIFY statement of a Notifier.
const notifyTimeout = 5 * time.Second

// A Notifier tells relays in other processes, on PostgreSQL, that this
// process committed outbox rows: each Outbox.Notify call (which
// pipeline's transactional handlers make after every commit) asks it for a
// NOTIFY on the outbox's channel, sent on its own short transaction after
// the writer's commit. It is the cross-process wake-up of an outbox
// configured with Config.NotifyAfterCommit.
//
// Requests are coalesced: one NOTIFY is in flight at a time, and all the
// requests that arrive meanwhile are answered by the next one, so a burst
// of commits costs a few statements, not one each, and the writers'
// commits are not serialised the way a pg_notify inside them serialises
// them. The NOTIFY's transaction skips the WAL flush wait: it writes nothing
// durable. A writer that dies between its commit and the NOTIFY leaves its
// rows to the relays' fallback poll.
//
// A Notifier starts no goroutine: it sends its NOTIFYs from Run, on the
// caller's goroutine, until Run's context ends or Close is called. Requests
// made between NewNotifier and Run wait for Run; those made after Run
// returned, or after Close, are dropped (the relays find those rows at
// their next poll). Close a Notifier that is never Run.
type Notifier struct {
	o       *core
	log     watermill.LoggerAdapter
	kick    chan struct{}
	closing chan struct{}
	done    chan struct{}
	started atomic.Bool
	once    sync.Once
}

// NewNotifier returns a Notifier that sends its NOTIFYs on the outbox's
// database. The outbox must be PostgreSQL with Config.NotifyAfterCommit set
// (otherwise its INSERT notifies already, or there is no NOTIFY). It
// touches no database and starts nothing until Run.
func (o *Outbox[TTx]) NewNotifier() (*Notifier, error) {
	if d := o.db.Dialect(); d != sqldb.Postgres {
		return nil, fmt.Errorf("outbox: NewNotifier: NOTIFY is PostgreSQL's, and this outbox's database is %q; relays in other processes find rows at their PollInterval", string(d))
	}
	if !o.c.cfg.NotifyAfterCommit {
		return nil, errors.New("outbox: NewNotifier: Config.NotifyAfterCommit is false, so the outbox's INSERT notifies in the writer's transaction already")
	}
	n := &Notifier{
		o: o.c, log: o.c.cfg.Logger,
		kick: make(chan struct{}, 1), closing: make(chan struct{}), done: make(chan struct{}),
	}
	o.c.mu.Lock()
	o.c.notifiers[n] = struct{}{}
	o.c.mu.Unlock()
	return n, nil
}

// forget stops the Notifier's requests.
func (n *Notifier) forget() {
	n.o.mu.Lock()
	delete(n.o.notifiers, n)
	n.o.mu.Unlock()
}

// Run sends the NOTIFYs that Outbox.Notify asks for until ctx ends or Close
// is called, and returns nil then. A request made before that still gets its
// NOTIFY, even when Close came before Run started. A Notifier runs once: a
// second Run returns an error; Run after Close returns at once.
func (n *Notifier) Run(ctx context.Context) error {
	if !n.started.CompareAndSwap(false, true) {
		return errors.New("outbox: notifier: Run called twice")
	}
	defer close(n.done)
	defer n.forget()
	for {
		select {
		case <-n.closing:
			n.flush()
			return nil
		case <-ctx.Done():
			n.flush()
			return nil
		case <-n.kick:
			n.send()
		}
	}
}

// flush sends the NOTIFY of a commit announced just before the end.
func (n *Notifier) flush() {
	select {
	case <-n.kick:
		n.send()
	default:
	}
}

// send runs one NOTIFY in a transaction of its own, which does not wait for
// its commit record to reach the disk (set_config with is_local applies to
// that transaction only).
// A failure is logged: the relays then find the rows at their next poll.
func (n *Notifier) send() {
	ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
	defer cancel()
	_, err := n.o.db.DB().Exec(ctx, `SELECT pg_notify($1, ''), set_config('synchronous_commit', 'off', true)`, n.o.q.table)
	if err != nil {
		n.log.Error("outbox: NOTIFY after commit failed; relays in other processes find the rows at their next poll", err,
			watermill.LogFields{"topic": n.o.cfg.Topic})
	}
}

// Close stops Run and waits for it to return: a request made before Close
// to a running Notifier still gets its NOTIFY (at most 5 s); requests made
// after are dropped.
// Close does not close the database; it never fails, the error is for
// io.Closer.
func (n *Notifier) Close() error {
	n.once.Do(func() {
		n.forget()
		close(n.closing)
		if n.started.Load() {
			<-n.done
		}
	})
	return nil
}
