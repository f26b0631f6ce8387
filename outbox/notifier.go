package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

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
// A Notifier runs one goroutine from the time it is made until Close.
type Notifier struct {
	o       *Outbox
	db      conn
	log     watermill.LoggerAdapter
	kick    chan struct{}
	closing chan struct{}
	done    chan struct{}
	once    sync.Once
}

// NewNotifier returns a Notifier that sends its NOTIFYs on db. The outbox
// must be PostgreSQL with Config.NotifyAfterCommit set (otherwise its
// INSERT notifies already, or there is no NOTIFY). The Notifier does not
// own db.
func (o *Outbox) NewNotifier(db *sql.DB) (*Notifier, error) {
	if db == nil {
		return nil, errors.New("outbox: NewNotifier: db is nil")
	}
	return o.newNotifier("NewNotifier", sqlConn(db))
}

// NewPgxNotifier is NewNotifier on a pgx pool.
func (o *Outbox) NewPgxNotifier(pool *pgxpool.Pool) (*Notifier, error) {
	if pool == nil {
		return nil, errors.New("outbox: NewPgxNotifier: pool is nil")
	}
	return o.newNotifier("NewPgxNotifier", pgxConn(pool))
}

func (o *Outbox) newNotifier(fn string, db conn) (*Notifier, error) {
	if o.cfg.Dialect != sqldb.Postgres {
		return nil, fmt.Errorf("outbox: %s: NOTIFY is PostgreSQL's, and this outbox's Config.Dialect is %q; relays in other processes find rows at their PollInterval", fn, string(o.cfg.Dialect))
	}
	if !o.cfg.NotifyAfterCommit {
		return nil, fmt.Errorf("outbox: %s: Config.NotifyAfterCommit is false, so the outbox's INSERT notifies in the writer's transaction already", fn)
	}
	n := &Notifier{
		o: o, db: db, log: o.cfg.Logger,
		kick: make(chan struct{}, 1), closing: make(chan struct{}), done: make(chan struct{}),
	}
	o.mu.Lock()
	o.notifiers[n] = struct{}{}
	o.mu.Unlock()
	go n.run()
	return n, nil
}

func (n *Notifier) run() {
	defer close(n.done)
	for {
		select {
		case <-n.closing:
			// A commit announced just before Close still gets its NOTIFY.
			select {
			case <-n.kick:
				n.send()
			default:
			}
			return
		case <-n.kick:
			n.send()
		}
	}
}

// send runs one NOTIFY in a transaction of its own, which does not wait for
// its commit record to reach the disk (set_config with is_local applies to
// that transaction only).
// A failure is logged: the relays then find the rows at their next poll.
func (n *Notifier) send() {
	ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
	defer cancel()
	_, err := n.db.ExecContext(ctx, `SELECT pg_notify($1, ''), set_config('synchronous_commit', 'off', true)`, n.o.q.table)
	if err != nil {
		n.log.Error("outbox: NOTIFY after commit failed; relays in other processes find the rows at their next poll", err,
			watermill.LogFields{"topic": n.o.cfg.Topic})
	}
}

// Close stops the Notifier. A request made before Close still gets its
// NOTIFY (Close waits for it, at most 5 s); requests made after are
// dropped. Close does not close the database; it never fails, the error is
// for io.Closer.
func (n *Notifier) Close() error {
	n.once.Do(func() {
		n.o.mu.Lock()
		delete(n.o.notifiers, n)
		n.o.mu.Unlock()
		close(n.closing)
		<-n.done
	})
	return nil
}
