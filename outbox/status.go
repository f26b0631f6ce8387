package outbox

import (
	"context"
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

type statusQuery struct {
	query string
}

type tableNamer interface{ MessagesTable(topic string) string }

type offsetsNamer interface{ MessagesOffsetsTable(topic string) string }

func newStatusQuery(d dedupe.Dialect, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter, topic string) statusQuery {
	namer, ok := schema.(tableNamer)
	onamer, ok2 := offsets.(offsetsNamer)
	if !ok || !ok2 {
		return statusQuery{} // custom adapters that do not name their tables: no status
	}
	msgs := namer.MessagesTable(topic)
	offs := onamer.MessagesOffsetsTable(topic)
	switch d {
	case dedupe.Postgres:
		return statusQuery{query: `SELECT COUNT(*), COALESCE(EXTRACT(EPOCH FROM (LOCALTIMESTAMP - MIN(m.created_at)))::float8, 0)
FROM ` + msgs + ` m
WHERE NOT EXISTS (
	SELECT 1 FROM ` + offs + ` o WHERE o.consumer_group = $1 AND (
		m.transaction_id < o.last_processed_transaction_id OR
		(m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked)))`}
	case dedupe.MySQL:
		return statusQuery{query: "SELECT COUNT(*), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), CURRENT_TIMESTAMP(6)) / 1000000, 0)\n" +
			"FROM " + msgs + " WHERE `offset` > COALESCE((SELECT offset_acked FROM " + offs + " WHERE consumer_group = ?), 0)"}
	default:
		return statusQuery{query: `SELECT COUNT(*), COALESCE((julianday('now') - julianday(MIN("created_at"))) * 86400.0, 0)
FROM ` + msgs + ` WHERE "offset" > COALESCE((SELECT "offset_acked" FROM ` + offs + ` WHERE "consumer_group" = ?), 0)`}
	}
}

// Status reports how many committed rows the relays of consumerGroup ("" is
// the default group) have not forwarded yet, and the age of the oldest.
func (o *Outbox) Status(ctx context.Context, db wsql.ContextExecutor, consumerGroup string) (Status, error) {
	if o.status.query == "" {
		return Status{}, fmt.Errorf("outbox: status: the configured adapters do not name their tables (MessagesTable, MessagesOffsetsTable)")
	}
	rows, err := db.QueryContext(ctx, o.status.query, consumerGroup)
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
