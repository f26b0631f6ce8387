package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// ParkedResults: section parked. The parked-message store's list and group
// queries on a table of a million rows, on PostgreSQL and MariaDB: what an
// operator's page (settle parked, the console) waits for.
type ParkedResults struct {
	Rows     int        `json:"rows"`
	Seed     int        `json:"seed"`   // rows written by Store.Park before doubling
	Groups   int        `json:"groups"` // failure groups among them
	Runs     int        `json:"runs"`   // timed runs of each query, after one warm-up
	TargetMS float64    `json:"target_ms"`
	DBs      []ParkedDB `json:"databases"`
	Queries  []string   `json:"queries"`
}

// ParkedDB is one database's figures.
type ParkedDB struct {
	Name        string             `json:"name"`
	FillSeconds float64            `json:"fill_seconds"`
	MedianMS    map[string]float64 `json:"median_ms"`
	MaxMS       map[string]float64 `json:"max_ms"`
}

// parkedQuery is one page an operator asks for.
type parkedQuery struct {
	name string
	run  func(ctx context.Context, s *parked.Store[*sql.Tx], w *parkedWorld) error
}

// parkedWorld is what the queries look for: values known to be in the table.
type parkedWorld struct {
	handler, topic, group, uuid, key string
	id                               int64
	deepCursor                       string
	windowFrom, windowTo             time.Time
	console                          http.Handler
}

const parkedHandlers = 20

var parkedQueries = []parkedQuery{
	{"groups: all", func(ctx context.Context, s *parked.Store[*sql.Tx], _ *parkedWorld) error {
		g, err := s.Groups(ctx, parked.Filter{})
		return atLeast(len(g), 1, err)
	}},
	{"groups: one handler", func(ctx context.Context, s *parked.Store[*sql.Tx], w *parkedWorld) error {
		g, err := s.Groups(ctx, parked.Filter{Handler: w.handler})
		return atLeast(len(g), 1, err)
	}},
	{"list: newest 50", listQ(func(*parkedWorld) parked.Query { return parked.Query{} })},
	{"list: state parked", listQ(func(*parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{State: parked.StateParked}}
	})},
	{"list: one handler", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Handler: w.handler}}
	})},
	{"list: one handler, parked", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Handler: w.handler, State: parked.StateParked}}
	})},
	{"list: one group", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Group: w.group}}
	})},
	{"list: one topic", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Topic: w.topic}}
	})},
	{"list: outcome poisoned", listQ(func(*parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Outcome: settle.Poisoned}}
	})},
	{"list: one hour, a week ago", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Since: w.windowFrom, Until: w.windowTo}}
	})},
	{"list: reason text (common)", listQ(func(*parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Reason: "connection refused"}}
	})},
	{"list: reason text (rare), one handler", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Handler: w.handler, Reason: "charge order 7:"}}
	})},
	{"list: by UUID", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{UUID: w.uuid}}
	})},
	{"list: by key", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Filter: parked.Filter{Key: w.key}}
	})},
	{"list: page 200 (cursor)", listQ(func(w *parkedWorld) parked.Query {
		return parked.Query{Cursor: w.deepCursor}
	})},
	{"message: one", func(ctx context.Context, s *parked.Store[*sql.Tx], w *parkedWorld) error {
		_, err := s.Get(ctx, w.id)
		return err
	}},
	// The console's pages, whole: every query a page makes, and its HTML.
	{"console: groups page", consolePage(func(*parkedWorld) string { return "/" })},
	{"console: a handler's messages", consolePage(func(w *parkedWorld) string { return "/messages?handler=" + url.QueryEscape(w.handler) })},
	{"console: a group's messages", consolePage(func(w *parkedWorld) string { return "/messages?group=" + url.QueryEscape(w.group) })},
	{"console: reason search", consolePage(func(*parkedWorld) string { return "/messages?reason=" + url.QueryEscape("charge order 7:") })},
	{"console: one message", consolePage(func(w *parkedWorld) string { return "/messages/" + strconv.FormatInt(w.id, 10) })},
	{"console: replay a group, confirmation", consolePage(func(w *parkedWorld) string {
		return "/confirm?action=replay&group=" + url.QueryEscape(w.group)
	})},
	{"console: activity, 24 hours", consolePage(func(*parkedWorld) string { return "/activity" })},
}

// consolePage times one GET of the console's handler, served in process.
func consolePage(path func(*parkedWorld) string) func(context.Context, *parked.Store[*sql.Tx], *parkedWorld) error {
	return func(ctx context.Context, _ *parked.Store[*sql.Tx], w *parkedWorld) error {
		req := httptest.NewRequestWithContext(ctx, http.MethodGet, path(w), nil)
		rec := httptest.NewRecorder()
		w.console.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			return fmt.Errorf("GET %s: %d %s", req.URL, rec.Code, rec.Body.String())
		}
		return nil
	}
}

func listQ(q func(*parkedWorld) parked.Query) func(context.Context, *parked.Store[*sql.Tx], *parkedWorld) error {
	return func(ctx context.Context, s *parked.Store[*sql.Tx], w *parkedWorld) error {
		p, err := s.List(ctx, q(w))
		return atLeast(len(p.Messages), 1, err)
	}
}

func atLeast(n, min int, err error) error {
	if err == nil && n < min {
		return fmt.Errorf("%d rows, want at least %d", n, min)
	}
	return err
}

func runParked(ctx context.Context, o options, log io.Writer) (*ParkedResults, error) {
	doublings := 10 // 1,024 seeds → 1,048,576 rows
	if o.quick {
		doublings = 7 // 131,072 rows
	}
	res := &ParkedResults{Seed: 1024, Rows: 1024 << doublings, Runs: 5, TargetMS: 200}
	for _, q := range parkedQueries {
		res.Queries = append(res.Queries, q.name)
	}
	for _, target := range []struct{ name, url string }{{"postgres", o.pgURL}, {"mariadb", o.mysqlURL}} {
		db, err := parkedDB(ctx, target.name, target.url, res, doublings, log)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", target.name, err)
		}
		res.DBs = append(res.DBs, db)
	}
	return res, nil
}

func parkedDB(ctx context.Context, name, url string, res *ParkedResults, doublings int, log io.Writer) (ParkedDB, error) {
	out := ParkedDB{Name: name, MedianMS: map[string]float64{}, MaxMS: map[string]float64{}}
	db, d, err := sqlurl.Open(url)
	if err != nil {
		return out, err
	}
	defer db.Close()
	db.SetMaxOpenConns(4)
	table := "bench_parked_" + randomID()
	s, err := parked.New(sqldb.Std(db, d), parked.Config{Table: table})
	if err != nil {
		return out, err
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = db.ExecContext(c, "DROP TABLE IF EXISTS "+table)
		_, _ = db.ExecContext(c, "DROP TABLE IF EXISTS "+table+"_groups")
	}()
	for _, stmt := range s.Schema() {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return out, fmt.Errorf("schema: %w", err)
		}
	}
	start := time.Now()
	groups, err := parkedSeed(ctx, s, res.Seed)
	if err != nil {
		return out, fmt.Errorf("seed: %w", err)
	}
	res.Groups = groups
	if err := parkedDouble(ctx, db, d, table, doublings); err != nil {
		return out, fmt.Errorf("fill: %w", err)
	}
	out.FillSeconds = time.Since(start).Seconds()
	var rows int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&rows); err != nil {
		return out, err
	}
	if rows != res.Rows {
		return out, fmt.Errorf("%d rows after the fill, want %d", rows, res.Rows)
	}
	fmt.Fprintf(log, "%s: %d parked rows in %d groups, filled in %.0fs\n", name, rows, groups, out.FillSeconds)

	w, err := parkedLookups(ctx, s, db, table)
	if err != nil {
		return out, err
	}
	drv := sqldb.Std(db, d)
	ob, err := outbox.New(drv, outbox.Config{Topic: table + "_ob"})
	if err != nil {
		return out, err
	}
	if err := ob.InitSchema(ctx); err != nil {
		return out, err
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = db.ExecContext(c, "DROP TABLE IF EXISTS "+table+"_ob")
		_, _ = db.ExecContext(c, "DROP TABLE IF EXISTS "+table+"_ob_relays")
	}()
	if w.console, err = console.New(console.Config[*sql.Tx]{Parked: s, Outbox: ob}); err != nil {
		return out, err
	}
	for _, q := range parkedQueries {
		var ms []float64
		for i := range res.Runs + 1 {
			t0 := time.Now()
			if err := q.run(ctx, s, w); err != nil {
				return out, fmt.Errorf("%s: %w", q.name, err)
			}
			if i > 0 { // the first run warms the cache
				ms = append(ms, float64(time.Since(t0).Microseconds())/1000)
			}
		}
		m := median(append([]float64(nil), ms...))
		hi := ms[0]
		for _, v := range ms {
			hi = max(hi, v)
		}
		out.MedianMS[q.name], out.MaxMS[q.name] = m, hi
		fmt.Fprintf(log, "%s %-40s median %7.1f ms  max %7.1f ms\n", name, q.name, m, hi)
	}
	return out, nil
}

// parkedSeed parks n messages through the store itself, spread over the
// handlers, five failure kinds each and a month of failure times, and
// returns the number of groups.
func parkedSeed(ctx context.Context, s *parked.Store[*sql.Tx], n int) (int, error) {
	now := time.Now()
	kinds := []func(i int) error{
		func(i int) error {
			return fmt.Errorf("charge order %d: dial tcp 10.0.%d.7:5432: connection refused", i, i%250)
		},
		func(i int) error { return fmt.Errorf("decode: invalid character 'x' at offset %d", i) },
		func(i int) error { return fmt.Errorf("order %d : customer %d not found", i, i*7) },
		func(i int) error { return fmt.Errorf("mail server said 550 for user-%d@example.com", i) },
		func(i int) error { return errors.New("payment provider timeout after 30s") },
	}
	for i := range n {
		h := "handler-" + strconv.Itoa(i%parkedHandlers)
		msg := message.NewMessage(fmt.Sprintf("seed-%08d-0000-0000-0000-000000000000", i), []byte(`{"order":`+strconv.Itoa(i)+`,"amount":1999,"currency":"EUR","lines":[{"sku":"A-1","qty":2}]}`))
		msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		msg.Metadata.Set("content_type", "application/json")
		outcome := settle.DeadLettered
		kind := (i / parkedHandlers) % len(kinds)
		if kind == 1 {
			outcome = settle.Poisoned
		}
		last := now.Add(-time.Duration(i) * 40 * time.Minute)
		err := s.Park(ctx, settle.Parked{
			Message: msg, Outcome: outcome, Cause: kinds[kind](i),
			Handler: h, Topic: "topic-" + strconv.Itoa(i%parkedHandlers), Key: "order:" + strconv.Itoa(i),
			Attempts: 5, FirstFailure: last.Add(-time.Minute), LastFailure: last,
			TraceID: fmt.Sprintf("%032x", i+1),
		})
		if err != nil {
			return 0, err
		}
	}
	g, err := s.Groups(ctx, parked.Filter{})
	return len(g), err
}

// parkedDouble doubles the table's rows k times with INSERT ... SELECT:
// each copy gets a new identity, UUID and key and a failure time shifted
// back, so the million rows spread over years of failures; then the group
// counts are recomputed from the rows.
func parkedDouble(ctx context.Context, db *sql.DB, d sqldb.Dialect, table string, k int) error {
	cols := "handler, topic, outcome, reason, group_id, attempts, trace_id, payload, metadata, state, replay_count, replayed_at, replayed_by, archived_at, archived_by, token, updated_at"
	for r := 1; r <= k; r++ {
		shift := int64(1024) << (r - 1) * 40 * 60 * 1_000_000 // µs: past the rows already there
		var q string
		switch d {
		case sqldb.Postgres:
			q = `INSERT INTO ` + table + ` (ident, uuid, dedupe_key, first_failure, last_failure, ` + cols + `)
SELECT sha256(ident || '\x` + fmt.Sprintf("%02x", r) + `'::bytea), uuid || convert_to('-r` + strconv.Itoa(r) + `', 'UTF8'),
	dedupe_key || convert_to('-r` + strconv.Itoa(r) + `', 'UTF8'), first_failure - $1, last_failure - $1, ` + cols + ` FROM ` + table
		case sqldb.MySQL:
			q = `INSERT INTO ` + table + ` (ident, uuid, dedupe_key, first_failure, last_failure, ` + cols + `)
SELECT UNHEX(SHA2(CONCAT(HEX(ident), '-` + strconv.Itoa(r) + `'), 256)), CONCAT(uuid, '-r` + strconv.Itoa(r) + `'),
	CONCAT(dedupe_key, '-r` + strconv.Itoa(r) + `'), first_failure - ?, last_failure - ?, ` + cols + ` FROM ` + table
		default:
			return fmt.Errorf("dialect %s", d)
		}
		args := []any{shift}
		if d == sqldb.MySQL {
			args = append(args, shift)
		}
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			return fmt.Errorf("doubling %d: %w", r, err)
		}
	}
	// The group counts, recomputed from the rows in one pass.
	g := table + "_groups"
	counts := `SELECT group_id, SUM(CASE WHEN state = 'parked' THEN 1 ELSE 0 END) AS p, COUNT(*) AS n, MIN(first_failure) AS f FROM ` + table + ` GROUP BY group_id`
	recount := `UPDATE ` + g + ` SET parked = x.p, total = x.n, first_seen = x.f FROM (` + counts + `) x WHERE x.group_id = ` + g + `.group_id`
	if d == sqldb.MySQL {
		recount = `UPDATE ` + g + ` JOIN (` + counts + `) x ON x.group_id = ` + g + `.group_id SET ` + g + `.parked = x.p, ` + g + `.total = x.n, ` + g + `.first_seen = x.f`
	}
	if _, err := db.ExecContext(ctx, recount); err != nil {
		return fmt.Errorf("group counts: %w", err)
	}
	analyze := "ANALYZE " + table
	if d == sqldb.MySQL {
		analyze = "ANALYZE TABLE " + table
	}
	_, err := db.ExecContext(ctx, analyze)
	return err
}

// parkedLookups picks the values the queries look for.
func parkedLookups(ctx context.Context, s *parked.Store[*sql.Tx], db *sql.DB, table string) (*parkedWorld, error) {
	w := &parkedWorld{handler: "handler-7", topic: "topic-7"}
	g, err := s.Groups(ctx, parked.Filter{Handler: w.handler})
	if err != nil || len(g) == 0 {
		return nil, fmt.Errorf("groups of %s: %d, %v", w.handler, len(g), err)
	}
	w.group = g[0].ID
	p, err := s.List(ctx, parked.Query{Filter: parked.Filter{Handler: w.handler}, Limit: 1})
	if err != nil || len(p.Messages) == 0 {
		return nil, fmt.Errorf("a row of %s: %v", w.handler, err)
	}
	w.id, w.uuid, w.key = p.Messages[0].ID, p.Messages[0].UUID, p.Messages[0].Key
	week := time.Now().Add(-7 * 24 * time.Hour)
	w.windowFrom, w.windowTo = week.Add(-time.Hour), week
	q := parked.Query{}
	for range 199 {
		p, err := s.List(ctx, q)
		if err != nil {
			return nil, err
		}
		if p.Next == "" {
			return nil, errors.New("fewer than 200 pages")
		}
		q.Cursor = p.Next
	}
	w.deepCursor = q.Cursor
	return w, nil
}

func parkedTable(r *ParkedResults) string {
	if r == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s parked rows in %d failure groups (%s parked through `Store.Park`, then doubled in SQL); median and slowest of %d runs after one warm-up, ms; target ≤ %.0f ms\n\n",
		num(float64(r.Rows)), r.Groups, num(float64(r.Seed)), r.Runs, r.TargetMS)
	b.WriteString("| page |")
	for _, d := range r.DBs {
		fmt.Fprintf(&b, " %s median | max |", d.Name)
	}
	b.WriteString("\n|---|")
	for range r.DBs {
		b.WriteString("---:|---:|")
	}
	b.WriteString("\n")
	for _, q := range r.Queries {
		fmt.Fprintf(&b, "| %s |", q)
		for _, d := range r.DBs {
			mark := ""
			if d.MaxMS[q] > r.TargetMS {
				mark = " (over)"
			}
			fmt.Fprintf(&b, " %.1f | %.1f%s |", d.MedianMS[q], d.MaxMS[q], mark)
		}
		b.WriteString("\n")
	}
	for _, d := range r.DBs {
		fmt.Fprintf(&b, "\nFill on %s: %.0f s.", d.Name, d.FillSeconds)
	}
	b.WriteString("\n")
	return b.String()
}
