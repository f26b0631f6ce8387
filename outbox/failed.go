package outbox

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// FailedRow is an outbox row whose publish has failed and that is not
// forwarded: waiting for its next attempt, or set aside.
type FailedRow struct {
	Offset int64
	UUID   string
	// Topic is the row's destination topic.
	Topic string
	// Bytes is the size of its payload and metadata.
	Bytes int64
	// Attempts counts its failed publishes since it was written or last
	// re-queued.
	Attempts int
	// LastError is the error of its latest failed publish (credentials in
	// URLs redacted, at most 1000 bytes).
	LastError string
	CreatedAt time.Time
	// NextAttemptAt is when a relay may try it again; zero when set aside.
	NextAttemptAt time.Time
	// SetAsideAt is when it was set aside; zero while it is retried.
	SetAsideAt time.Time
}

// Selection picks failed rows for Failed and Requeue. Its fields narrow the
// selection; the zero Selection picks every failed row.
type Selection struct {
	// Offsets, when not empty, picks only these rows. At most
	// 1000.
	Offsets []int64
	// Topic, when not empty, picks only rows to this destination topic.
	Topic string
	// SetAsideOnly makes Failed list only rows set aside (Requeue takes
	// only those anyway).
	SetAsideOnly bool
	// Limit is the most rows Failed returns, oldest first. 0 means 100;
	// at most 10000. Requeue ignores it.
	Limit int
}

// maxSelectionOffsets is the most offsets one Selection names.
const maxSelectionOffsets = 1000

func (s Selection) validate() error {
	switch {
	case len(s.Offsets) > maxSelectionOffsets:
		return fmt.Errorf("outbox: Selection.Offsets names %d rows, at most %d", len(s.Offsets), maxSelectionOffsets)
	case s.Limit < 0 || s.Limit > 10000:
		return fmt.Errorf("outbox: Selection.Limit must be 0-10000, got %d", s.Limit)
	}
	return nil
}

// where returns the conditions of s after those given, and their arguments,
// numbering PostgreSQL's placeholders from 1.
func (o *core) where(s Selection, setAsideOnly bool) (string, []any) {
	var conds []string
	var args []any
	ph := func(v any) string {
		args = append(args, v)
		if o.q.d == sqldb.Postgres {
			return "$" + strconv.Itoa(len(args))
		}
		return "?"
	}
	id := func(n string) string { return sqlkit.Quote(o.q.d, n) }
	conds = append(conds, id("forwarded_at")+" IS NULL")
	if setAsideOnly {
		conds = append(conds, id("set_aside_at")+" IS NOT NULL")
	} else {
		conds = append(conds, "("+id("set_aside_at")+" IS NOT NULL OR "+id("attempts")+" > 0)")
	}
	if s.Topic != "" {
		conds = append(conds, id("topic")+" = "+ph(s.Topic))
	}
	if len(s.Offsets) > 0 {
		in := make([]string, len(s.Offsets))
		for i, off := range s.Offsets {
			in[i] = ph(off)
		}
		conds = append(conds, id("offset")+" IN ("+strings.Join(in, ", ")+")")
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

// epoch is the SQL of column c as seconds since 1970, 0 when NULL.
func (o *core) epoch(c string) string {
	c = sqlkit.Quote(o.q.d, c)
	switch o.q.d {
	case sqldb.Postgres:
		return "COALESCE(EXTRACT(EPOCH FROM " + c + ")::float8, 0)"
	case sqldb.MySQL:
		return "COALESCE(UNIX_TIMESTAMP(" + c + "), 0)"
	default:
		return "COALESCE((julianday(" + c + ") - 2440587.5) * 86400.0, 0)"
	}
}

func (o *core) sizeExpr() string {
	switch o.q.d {
	case sqldb.Postgres:
		return `octet_length("payload") + octet_length("metadata")`
	case sqldb.MySQL:
		return "LENGTH(payload) + LENGTH(metadata)"
	default:
		return `length("payload") + length(CAST("metadata" AS BLOB))`
	}
}

func fromEpoch(s float64) time.Time {
	if s == 0 {
		return time.Time{}
	}
	sec, frac := math.Modf(s)
	return time.Unix(int64(sec), int64(frac*1e9)).UTC().Round(time.Microsecond)
}

// Failed lists the outbox's rows whose publish has failed and that are not
// forwarded, oldest first: those waiting for their next attempt and those
// set aside, or only the latter with SetAsideOnly. It reads only.
func (o *Outbox[TTx]) Failed(ctx context.Context, sel Selection) ([]FailedRow, error) {
	return o.c.failed(ctx, sel)
}

func (o *core) failed(ctx context.Context, sel Selection) ([]FailedRow, error) {
	if err := sel.validate(); err != nil {
		return nil, err
	}
	limit := sel.Limit
	if limit == 0 {
		limit = 100
	}
	id := func(n string) string { return sqlkit.Quote(o.q.d, n) }
	where, args := o.where(sel, sel.SetAsideOnly)
	q := "SELECT " + id("offset") + ", " + id("uuid") + ", " + id("topic") + ", " + o.sizeExpr() + ", " + id("attempts") + ", COALESCE(" + id("last_error") + ", ''), " +
		o.epoch("created_at") + ", " + o.epoch("next_attempt_at") + ", " + o.epoch("set_aside_at") +
		" FROM " + o.q.qTable + where + " ORDER BY " + id("offset") + " LIMIT " + strconv.Itoa(limit)
	var out []FailedRow
	err := o.db.DB().Query(ctx, q, args, func(scan func(...any) error) error {
		var f FailedRow
		var created, next, aside float64
		if err := scan(&f.Offset, &f.UUID, &f.Topic, &f.Bytes, &f.Attempts, &f.LastError, &created, &next, &aside); err != nil {
			return err
		}
		f.CreatedAt, f.NextAttemptAt, f.SetAsideAt = fromEpoch(created), fromEpoch(next), fromEpoch(aside)
		if !f.SetAsideAt.IsZero() {
			f.NextAttemptAt = time.Time{}
		}
		out = append(out, f)
		return nil
	})
	if err != nil {
		return nil, o.schemaHint(ctx, fmt.Errorf("outbox: failed rows: %w", err))
	}
	return out, nil
}

// Requeue puts the set-aside rows that sel picks back in the outbox: their
// failure count starts again from 0 (the relay's MaxAttempts applies anew),
// and relays forward them at their next batch (at once on PostgreSQL, whose
// relays it notifies; at their next poll elsewhere). It returns how many
// rows it re-queued. Rows waiting for their next attempt are not touched.
// The zero Selection re-queues every set-aside row.
func (o *Outbox[TTx]) Requeue(ctx context.Context, sel Selection) (int64, error) {
	return o.c.requeue(ctx, sel)
}

func (o *core) requeue(ctx context.Context, sel Selection) (int64, error) {
	if err := sel.validate(); err != nil {
		return 0, err
	}
	id := func(n string) string { return sqlkit.Quote(o.q.d, n) }
	where, args := o.where(sel, true)
	q := "UPDATE " + o.q.qTable + " SET " + id("set_aside_at") + " = NULL, " + id("next_attempt_at") + " = NULL, " + id("attempts") + " = 0" + where
	tx, err := o.db.begin(ctx, nil, "")
	if err != nil {
		return 0, fmt.Errorf("outbox: requeue: %w", err)
	}
	defer func() { _ = tx.rollback(context.WithoutCancel(ctx)) }()
	n, err := tx.Exec(ctx, q, args...)
	if err != nil {
		return 0, o.schemaHint(ctx, fmt.Errorf("outbox: requeue: %w", err))
	}
	if n > 0 && o.q.d == sqldb.Postgres {
		if _, err := tx.Exec(ctx, "SELECT pg_notify($1, '')", o.q.table); err != nil {
			return 0, fmt.Errorf("outbox: requeue: notify: %w", err)
		}
	}
	if err := tx.commit(ctx); err != nil {
		return 0, fmt.Errorf("outbox: requeue: %w", err)
	}
	o.notify()
	return n, nil
}
