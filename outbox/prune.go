package outbox

import (
	"context"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/settle-go/settle/dedupe"
)

// pruneBatch is how many rows one DELETE of Prune removes.
const pruneBatch = 5000

// pruneQuery returns the DELETE of at most pruneBatch rows that the relays
// of a consumer group have forwarded and that are older than a number of
// seconds. Args: consumer group, seconds, limit. The newest forwarded row is
// always kept, so that a table's next offset can never go back to one
// already forwarded.
func pruneQuery(d dedupe.Dialect, msgs, offs string) string {
	switch d {
	case dedupe.Postgres:
		return `DELETE FROM ` + msgs + ` WHERE "offset" IN (
	SELECT m."offset" FROM ` + msgs + ` m JOIN ` + offs + ` o ON o.consumer_group = $1
	WHERE (m.transaction_id < o.last_processed_transaction_id OR
		(m.transaction_id = o.last_processed_transaction_id AND m."offset" < o.offset_acked))
	AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $2)
	LIMIT $3)`
	case dedupe.MySQL:
		return "DELETE FROM " + msgs + " WHERE `offset` < COALESCE((SELECT offset_acked FROM " + offs + " WHERE consumer_group = ?), 0)\n" +
			"AND created_at <= CURRENT_TIMESTAMP - INTERVAL ? SECOND LIMIT ?"
	default:
		return `DELETE FROM ` + msgs + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + msgs + ` WHERE "offset" < COALESCE((SELECT "offset_acked" FROM ` + offs + ` WHERE "consumer_group" = ?), 0)
	AND "created_at" < strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ? || ' seconds')
	LIMIT ?)`
	}
}

// Prune deletes outbox rows that the relays of consumerGroup ("" is the
// default group) have forwarded and that were written more than olderThan
// ago (whole seconds on MySQL, whose created_at has no fraction), in
// batches, and returns how many it deleted. watermill-sql never
// deletes forwarded rows by itself, so without pruning the outbox table
// grows for ever. Rows not yet forwarded are never deleted, and the newest
// forwarded row is kept as the relay's bookmark. If several consumer groups
// read the outbox, prune with the slowest one.
func (o *Outbox) Prune(ctx context.Context, db wsql.ContextExecutor, consumerGroup string, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("outbox: prune: olderThan must be >= 0, got %v", olderThan)
	}
	if o.q.prune == "" {
		return 0, fmt.Errorf("outbox: prune: %w", errUnnamedTables)
	}
	var secs any = olderThan.Seconds()
	if o.cfg.Dialect == dedupe.MySQL {
		secs = int64(olderThan / time.Second) // INTERVAL takes whole seconds
	}
	var total int64
	for {
		res, err := db.ExecContext(ctx, o.q.prune, consumerGroup, secs, pruneBatch)
		if err != nil {
			return total, fmt.Errorf("outbox: prune: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, fmt.Errorf("outbox: prune: %w", err)
		}
		total += n
		if n < pruneBatch {
			return total, nil
		}
	}
}
