package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"time"

	"github.com/settle-go/settle/sqldb"
)

// pruneBatch is how many rows one DELETE of Prune removes.
const pruneBatch = 5000

// Prune deletes the outbox rows forwarded before before, in batches, and
// returns how many it deleted. Without pruning the outbox table grows for
// ever; rows not yet forwarded (set aside ones included) are never deleted,
// and the relay keeps no position that a delete could disturb. Keep before
// far enough back to look at what was forwarded when something goes wrong
// downstream. The cut-off is time.Since(before) back from the database's
// clock, which stamped forwarded_at; a before in the future prunes every
// forwarded row.
func (o *Outbox[TTx]) Prune(ctx context.Context, before time.Time) (int64, error) {
	return o.c.prune(ctx, before)
}

func (c *core) prune(ctx context.Context, before time.Time) (int64, error) {
	age := c.pruneAge(before)
	var total int64
	for {
		n, err := c.pruneBatch(ctx, age)
		if err != nil {
			return total, c.schemaHint(ctx, fmt.Errorf("outbox: prune: %w", err))
		}
		total += n
		if n < pruneBatch {
			return total, nil
		}
	}
}

// pruneAge is the argument of the prune's filter (q.pruneWhere) for the
// cut-off before: how long ago it was, in seconds (MySQL: microseconds;
// SQLite: seconds as text).
func (c *core) pruneAge(before time.Time) any {
	olderThan := max(time.Since(before), 0)
	switch c.q.d {
	case sqldb.MySQL:
		return olderThan.Microseconds()
	case sqldb.SQLite:
		// Text in the statement's modifier: SQLite would print a small
		// REAL in exponent form ("1e-05 seconds"), which it does not read.
		return strconv.FormatFloat(olderThan.Seconds(), 'f', 6, 64)
	}
	return olderThan.Seconds()
}

// pruneBatch deletes one batch in a transaction of its own, READ COMMITTED
// outside SQLite: MySQL's default level would lock the gap where writers
// insert new rows into the index of pending rows.
func (c *core) pruneBatch(ctx context.Context, age any) (int64, error) {
	var opts *sql.TxOptions
	if c.q.d != sqldb.SQLite {
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	tx, err := c.db.begin(ctx, opts, "")
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.rollback(context.WithoutCancel(ctx)) }()
	n, err := tx.Exec(ctx, c.q.prune, age, pruneBatch)
	if err != nil {
		return 0, err
	}
	return n, tx.commit(ctx)
}
