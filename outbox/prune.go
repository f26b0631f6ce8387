package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/settle-go/settle/sqldb"
)

// pruneBatch is how many rows one DELETE of Prune removes.
const pruneBatch = 5000

// Prune deletes outbox rows forwarded more than olderThan ago, in batches,
// and returns how many it deleted. Without pruning the outbox table grows
// for ever; rows not yet forwarded are never deleted, and the relay keeps no
// position that a delete could disturb. Keep olderThan long enough to look
// at what was forwarded when something goes wrong downstream.
func (o *Outbox) Prune(ctx context.Context, db *sql.DB, olderThan time.Duration) (int64, error) {
	if db == nil {
		return 0, errors.New("outbox: Prune: db is nil")
	}
	return o.prune(ctx, sqlConn(db), olderThan)
}

func (o *Outbox) prune(ctx context.Context, db conn, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("outbox: prune: olderThan must be >= 0, got %v", olderThan)
	}
	var age any = olderThan.Seconds()
	if o.cfg.Dialect == sqldb.MySQL {
		age = olderThan.Microseconds()
	}
	var total int64
	for {
		n, err := o.pruneBatch(ctx, db, age)
		if err != nil {
			return total, o.schemaHint(ctx, db, fmt.Errorf("outbox: prune: %w", err))
		}
		total += n
		if n < pruneBatch {
			return total, nil
		}
	}
}

// pruneBatch deletes one batch in a transaction of its own, READ COMMITTED
// outside SQLite: MySQL's default level would lock the gap where writers
// insert new rows into the index of pending rows.
func (o *Outbox) pruneBatch(ctx context.Context, db conn, age any) (int64, error) {
	var opts *sql.TxOptions
	if o.cfg.Dialect != sqldb.SQLite {
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	res, err := tx.ExecContext(ctx, o.q.prune, age, pruneBatch)
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	return n, tx.Commit()
}
