package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/settle-go/settle/dedupe"
)

// Status is the backlog of an outbox for one consumer group of relays.
type Status struct {
	// Pending counts committed rows not yet forwarded.
	Pending int64
	// Lag is the age of the oldest pending row, 0 when none is pending. Its
	// resolution is the database's created_at column: a second on MySQL, a
	// millisecond on SQLite, a microsecond on PostgreSQL.
	Lag time.Duration
}

// tableQueries are the statements of Status and Prune, built once by New
// from the adapters' table names. They are empty for custom adapters that do
// not name their tables.
type tableQueries struct {
	status string
	prune  string
}

type tableNamer interface{ MessagesTable(topic string) string }

type offsetsNamer interface{ MessagesOffsetsTable(topic string) string }

var errUnnamedTables = errors.New("the configured adapters do not name their tables (MessagesTable, MessagesOffsetsTable)")

func newTableQueries(d dedupe.Dialect, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter, topic string) tableQueries {
	namer, ok := schema.(tableNamer)
	onamer, ok2 := offsets.(offsetsNamer)
	if !ok || !ok2 {
		return tableQueries{}
	}
	msgs := namer.MessagesTable(topic)
	offs := onamer.MessagesOffsetsTable(topic)
	return tableQueries{status: statusQuery(d, msgs, offs), prune: pruneQuery(d, msgs, offs)}
}

// statusQuery counts the rows a consumer group has not forwarded and the
// age of the oldest. Args: consumer group.
func statusQuery(d dedupe.Dialect, msgs, offs string) string {
	switch d {
	case dedupe.Postgres:
		return `SELECT COUNT(*), COALESCE(EXTRACT(EPOCH FROM (LOCALTIMESTAMP - MIN(m.created_at)))::float8, 0)
FROM ` + msgs + ` m
WHERE NOT EXISTS (
	SELECT 1 FROM ` + offs + ` o WHERE o.consumer_group = $1 AND (
		m.transaction_id < o.last_processed_transaction_id OR
		(m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked)))`
	case dedupe.MySQL:
		return "SELECT COUNT(*), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), CURRENT_TIMESTAMP(6)) / 1000000, 0)\n" +
			"FROM " + msgs + " WHERE `offset` > COALESCE((SELECT offset_acked FROM " + offs + " WHERE consumer_group = ?), 0)"
	default:
		return `SELECT COUNT(*), COALESCE((julianday('now') - julianday(MIN("created_at"))) * 86400.0, 0)
FROM ` + msgs + ` WHERE "offset" > COALESCE((SELECT "offset_acked" FROM ` + offs + ` WHERE "consumer_group" = ?), 0)`
	}
}

// Status reports how many committed rows the relays of consumerGroup ("" is
// the default group) have not forwarded yet, and the age of the oldest.
func (o *Outbox) Status(ctx context.Context, db wsql.ContextExecutor, consumerGroup string) (Status, error) {
	if o.q.status == "" {
		return Status{}, fmt.Errorf("outbox: status: %w", errUnnamedTables)
	}
	rows, err := db.QueryContext(ctx, o.q.status, consumerGroup)
	if err != nil {
		return Status{}, fmt.Errorf("outbox: status: %w", err)
	}
	defer rows.Close()
	var st Status
	var lag float64
	if !rows.Next() {
		return Status{}, fmt.Errorf("outbox: status: no row")
	}
	if err := rows.Scan(&st.Pending, &lag); err != nil {
		return Status{}, fmt.Errorf("outbox: status: %w", err)
	}
	if st.Pending > 0 && lag > 0 {
		st.Lag = time.Duration(lag * float64(time.Second))
	}
	return st, nil
}
