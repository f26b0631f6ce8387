package parked

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/mdcolumn"
	"github.com/settle-go/settle/sqldb"
)

// where appends the conditions of f to b, each after " AND ", on the
// columns of the rows table.
func (s *Store[TTx]) where(b *builder, f Filter) {
	if len(f.IDs) > 0 {
		b.sql(" AND id IN ").in(f.IDs)
	}
	eq := func(col string, v any) { b.sql(" AND ", col, " = ").arg(v) }
	if f.Handler != "" {
		eq("handler", cutRunes(clean(f.Handler), maxName))
	}
	if f.Topic != "" {
		eq("topic", cutRunes(clean(f.Topic), maxName))
	}
	if f.Outcome != "" {
		eq("outcome", string(f.Outcome))
	}
	if f.Group != "" {
		eq("group_id", f.Group)
	}
	if f.State != "" {
		eq("state", string(f.State))
	}
	// A UUID or key is found by the index of its prefix, then compared
	// whole.
	bin := func(col, v string) {
		if s.q.d == sqldb.Postgres {
			b.sql(" AND ", s.q.prefix(col), " = substring(").arg(bytesOf(v)).sql("::bytea from 1 for " + strconv.Itoa(binPrefix) + ")")
		}
		eq(col, bytesOf(v))
	}
	if f.UUID != "" {
		bin("uuid", f.UUID)
	}
	if f.Key != "" {
		bin("dedupe_key", f.Key)
	}
	if f.Reason != "" {
		if s.q.d == sqldb.SQLite {
			// SQLite's LIKE ignores the case of ASCII letters; instr
			// does not, as LIKE elsewhere.
			b.sql(" AND instr(reason, ").arg(clean(f.Reason)).sql(") > 0")
		} else {
			b.sql(" AND reason LIKE ").arg("%" + likeEscape(clean(f.Reason)) + "%").sql(" ESCAPE '!'")
		}
	}
	if !f.Since.IsZero() {
		b.sql(" AND last_failure >= ").arg(micros(f.Since))
	}
	if !f.Until.IsZero() {
		b.sql(" AND last_failure < ").arg(micros(f.Until))
	}
}

// likeEscape escapes LIKE's wildcards, and its escape character '!', in s.
func likeEscape(s string) string {
	return strings.NewReplacer("!", "!!", "%", "!%", "_", "!_").Replace(s)
}

// scanRow reads rowCols, then payload and metadata when full.
func scanRow(scan func(dest ...any) error, full bool) (Message, error) {
	var (
		m                                   Message
		uuid, key, payload                  []byte
		outcome, state, md                  string
		first, last, replayedAt, archivedAt int64
	)
	dest := []any{&m.ID, &m.Handler, &m.Topic, &uuid, &key, &outcome, &m.Reason, &m.Group, &m.Attempts, &first, &last, &m.TraceID,
		&state, &m.Replays, &replayedAt, &m.ReplayedBy, &archivedAt, &m.ArchivedBy}
	if full {
		dest = append(dest, &payload, &md)
	}
	if err := scan(dest...); err != nil {
		return Message{}, err
	}
	m.UUID, m.Key, m.Outcome, m.State = string(uuid), string(key), settle.Outcome(outcome), State(state)
	m.FirstFailure, m.LastFailure = fromMicros(first), fromMicros(last)
	m.ReplayedAt, m.ArchivedAt = fromMicros(replayedAt), fromMicros(archivedAt)
	if full {
		m.Payload = payload
		if m.Payload == nil {
			m.Payload = []byte{}
		}
		meta, err := mdcolumn.Decode(md)
		if err != nil {
			return Message{}, fmt.Errorf("metadata of row %d: %w", m.ID, err)
		}
		m.Metadata = meta
	}
	return m, nil
}

// Get returns the row id, whole; ErrNotFound when there is none.
func (s *Store[TTx]) Get(ctx context.Context, id int64) (Message, error) {
	b := s.q.build().sql("SELECT ", rowCols, ", payload, metadata FROM ", s.q.t, " WHERE id = ").arg(id)
	var m Message
	found := false
	err := s.db.DB().Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		var err error
		m, err = scanRow(scan, true)
		found = err == nil
		return err
	})
	if err != nil {
		return Message{}, fmt.Errorf("parked: Get %d: %w", id, err)
	}
	if !found {
		return Message{}, ErrNotFound
	}
	return m, nil
}

// cursor is the position of a page's last row in the order of List.
type cursor struct{ last, id int64 }

func (c cursor) String() string {
	return base64.RawURLEncoding.EncodeToString([]byte("1." + strconv.FormatInt(c.last, 10) + "." + strconv.FormatInt(c.id, 10)))
}

func parseCursor(s string) (cursor, error) {
	bad := invalidf("Query.Cursor %q is not a cursor of List", s)
	raw, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return cursor{}, bad
	}
	parts := strings.Split(string(raw), ".")
	if len(parts) != 3 || parts[0] != "1" {
		return cursor{}, bad
	}
	last, err1 := strconv.ParseInt(parts[1], 10, 64)
	id, err2 := strconv.ParseInt(parts[2], 10, 64)
	if err1 != nil || err2 != nil {
		return cursor{}, bad
	}
	return cursor{last, id}, nil
}

// listScan bounds the rows one page of List reads to find its rows when
// the filter has a condition no index orders (see List).
const listScan = 5000

// List returns one page of the rows q selects, newest last failure first,
// then by descending ID: every field of a Message but Payload and Metadata
// (nil; Get returns them). Pages are read by keyset (no OFFSET), so a page
// far down costs what the first does.
//
// A filter that an index answers in order (one of Group, Handler, Topic or
// State, with Since and Until; or UUID, Key or IDs) gives full pages. A
// filter with more (a Reason, an Outcome, or two of Group, Handler, Topic
// and State) reads at most 5,000 rows of the first one for a page, so that
// a text that matches almost nothing does not read the whole table for
// one page: such a page may hold fewer rows than the Limit, or none, and
// still have a Next, which goes on with the rows after those read.
func (s *Store[TTx]) List(ctx context.Context, q Query) (Page, error) {
	if err := q.validate(); err != nil {
		return Page{}, fmt.Errorf("parked: List: %w", err)
	}
	limit := q.Limit
	switch {
	case limit == 0:
		limit = defaultLimit
	case limit < 0 || limit > maxLimit:
		return Page{}, fmt.Errorf("parked: List: %w", invalidf("Query.Limit must be 0-%d, got %d", maxLimit, q.Limit))
	}
	var after *cursor
	if q.Cursor != "" {
		c, err := parseCursor(q.Cursor)
		if err != nil {
			return Page{}, fmt.Errorf("parked: List: %w", err)
		}
		after = &c
	}
	// The end of the rows this page may read, when the filter needs one.
	var end *cursor
	if prim, bounded := primary(q.Filter); bounded {
		b := s.q.build().sql("SELECT last_failure, id FROM ", s.q.t, " WHERE 1 = 1")
		s.where(b, prim)
		s.keyset(b, after, "<")
		b.sql(" ORDER BY last_failure DESC, id DESC LIMIT 1 OFFSET ").arg(s.scan - 1)
		var c cursor
		switch err := s.db.DB().QueryRow(ctx, b.String(), b.args, &c.last, &c.id); {
		case err == nil:
			end = &c
		case !errors.Is(err, sql.ErrNoRows):
			return Page{}, fmt.Errorf("parked: List: %w", err)
		}
	}
	b := s.q.build().sql("SELECT ", rowCols, " FROM ", s.q.t, " WHERE 1 = 1")
	s.where(b, q.Filter)
	s.keyset(b, after, "<")
	s.keyset(b, end, ">=")
	b.sql(" ORDER BY last_failure DESC, id DESC LIMIT ").arg(limit + 1)
	var page Page
	err := s.db.DB().Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		m, err := scanRow(scan, false)
		if err != nil {
			return err
		}
		page.Messages = append(page.Messages, m)
		return nil
	})
	if err != nil {
		return Page{}, fmt.Errorf("parked: List: %w", err)
	}
	switch {
	case len(page.Messages) > limit:
		page.Messages = page.Messages[:limit]
		last := page.Messages[limit-1]
		page.Next = cursor{micros(last.LastFailure), last.ID}.String()
	case end != nil:
		// Rows remain past those this page read.
		page.Next = cursor{end.last, end.id}.String()
	}
	return page, nil
}

// keyset appends the condition that a row comes before (op "<": after, in
// List's descending order) or not after (">=") c, if c is not nil.
func (s *Store[TTx]) keyset(b *builder, c *cursor, op string) {
	if c == nil {
		return
	}
	if s.q.d == sqldb.Postgres {
		b.sql(" AND (last_failure, id) ", op, " (").arg(c.last).sql(", ").arg(c.id).sql(")")
		return
	}
	if op == "<" {
		b.sql(" AND (last_failure < ").arg(c.last).sql(" OR (last_failure = ").arg(c.last).sql(" AND id < ").arg(c.id).sql("))")
		return
	}
	b.sql(" AND (last_failure > ").arg(c.last).sql(" OR (last_failure = ").arg(c.last).sql(" AND id >= ").arg(c.id).sql("))")
}

// primary returns the part of f an index of the rows table answers in
// List's order, and whether f has more than that (List then bounds the
// rows a page reads). Point lookups (IDs, UUID, Key) need no bound.
func primary(f Filter) (Filter, bool) {
	if len(f.IDs) > 0 || f.UUID != "" || f.Key != "" {
		return f, false
	}
	p := Filter{Since: f.Since, Until: f.Until}
	switch {
	case f.Group != "":
		p.Group = f.Group
	case f.Handler != "":
		p.Handler = f.Handler
	case f.Topic != "":
		p.Topic = f.Topic
	case f.State != "":
		p.State = f.State
	}
	n := 0
	for _, set := range []bool{f.Group != "", f.Handler != "", f.Topic != "", f.State != ""} {
		if set {
			n++
		}
	}
	return p, n > 1 || f.Reason != "" || f.Outcome != ""
}

// Count returns the number of rows f selects. It reads them (through an
// index where f has one): at volume, the counts per failure group come
// from Groups without reading rows.
func (s *Store[TTx]) Count(ctx context.Context, f Filter) (int64, error) {
	if err := f.validate(); err != nil {
		return 0, fmt.Errorf("parked: Count: %w", err)
	}
	b := s.q.build().sql("SELECT COUNT(*) FROM ", s.q.t, " WHERE 1 = 1")
	s.where(b, f)
	var n int64
	if err := s.db.DB().QueryRow(ctx, b.String(), b.args, &n); err != nil {
		return 0, fmt.Errorf("parked: Count: %w", err)
	}
	return n, nil
}

// Groups returns the failure groups with a row selected by f's Handler and
// Outcome (other fields are ignored), most recently seen first, from the
// group counts table: it reads no parked row.
func (s *Store[TTx]) Groups(ctx context.Context, f Filter) ([]Group, error) {
	b := s.q.build().sql("SELECT ", groupCols, " FROM ", s.q.g, " WHERE total > 0")
	if f.Handler != "" {
		b.sql(" AND handler = ").arg(cutRunes(clean(f.Handler), maxName))
	}
	if f.Outcome != "" {
		b.sql(" AND outcome = ").arg(string(f.Outcome))
	}
	b.sql(" ORDER BY last_seen DESC, group_id")
	var out []Group
	err := s.db.DB().Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		var (
			g           Group
			outcome     string
			first, last int64
		)
		if err := scan(&g.ID, &g.Handler, &g.ErrorType, &g.Text, &outcome, &g.Parked, &g.Total, &first, &last); err != nil {
			return err
		}
		g.Outcome, g.FirstSeen, g.LastSeen = settle.Outcome(outcome), fromMicros(first), fromMicros(last)
		out = append(out, g)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("parked: Groups: %w", err)
	}
	return out, nil
}

// sortedKeys returns the keys of m in order.
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, cmp.Compare[string])
	return keys
}
