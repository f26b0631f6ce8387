package parked_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/mdcolumn"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// The store's tests run on every driver: database/sql on SQLite,
// PostgreSQL and MariaDB (with and without clientFoundRows), and pgx on
// PostgreSQL. A test body sees the store through api, the same whatever
// the driver's transaction type, and replays through env.replay, bound to
// an outbox of the same database.
type drv struct {
	name string
	pgx  bool
	open func(testing.TB) testenv.DB
}

func drivers() []drv {
	var ds []drv
	for _, d := range testenv.Databases() {
		ds = append(ds, drv{name: d.Name, open: d.Open})
	}
	return append(ds, drv{name: "pgx", pgx: true, open: testenv.Postgres})
}

// api is what a Store does whatever its transaction type, but Replay.
type api interface {
	Schema() []string
	Check(context.Context) error
	Park(context.Context, settle.Parked) error
	Get(context.Context, int64) (parked.Message, error)
	List(context.Context, parked.Query) (parked.Page, error)
	Count(context.Context, parked.Filter) (int64, error)
	Groups(context.Context, parked.Filter) ([]parked.Group, error)
	Preview(context.Context, parked.Filter, parked.ReplayOptions) (parked.ReplayResult, error)
	Archive(context.Context, parked.Filter, string) (int64, error)
	Prune(context.Context, time.Time) (int64, error)
	Purge(context.Context, parked.Filter) (int64, error)
}

// handle is a store and its replay through an outbox, on one pool.
type handle struct {
	api
	replay func(context.Context, parked.Filter, parked.ReplayOptions) (parked.ReplayResult, error)
	// relay makes a relay of the outbox replay writes to.
	relay func(message.Publisher, outbox.RelayConfig) (*outbox.Relay, error)
}

type env struct {
	d      drv
	db     testenv.DB // the test's own statements
	table  string
	topic  string // the outbox's
	cfg    parked.Config
	handle        // on the pool of the driver under test
	sqlite string // the SQLite file, for another pool
}

func (e *env) q(name string) string {
	if e.db.Dialect == sqldb.MySQL {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}

// setup makes the tables of a store and an outbox with names of the test's
// own, and drops them when it ends.
func setup(t *testing.T, d drv, cfg parked.Config) *env {
	t.Helper()
	e := &env{d: d, db: d.open(t)}
	name := testenv.Name(t, "pk")
	e.table = "pk_" + name[len(name)-8:]
	e.topic = "ob_" + name[len(name)-8:]
	cfg.Table = e.table
	e.cfg = cfg
	if e.db.Dialect == sqldb.SQLite {
		var path string
		if err := e.db.QueryRowContext(t.Context(), "SELECT file FROM pragma_database_list WHERE name = 'main'").Scan(&path); err != nil {
			t.Fatal(err)
		}
		e.sqlite = path
	}
	e.handle = e.open(t, e.db)
	st, err := parked.New(sqldb.Std(e.db.DB, e.db.Dialect), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(sqldb.Std(e.db.DB, e.db.Dialect), outbox.Config{Topic: e.topic})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, tb := range []string{e.table, e.table + "_groups", e.topic, e.topic + "_relays"} {
			_, _ = e.db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+e.q(tb))
		}
	})
	for _, s := range st.Schema() {
		if _, err := e.db.ExecContext(t.Context(), s); err != nil {
			t.Fatalf("%s\n%v", s, err)
		}
	}
	if err := ob.InitSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	return e
}

// open returns a handle on the driver under test: on db's pool, or for pgx
// on a pgx pool of its own.
func (e *env) open(t testing.TB, db testenv.DB) handle {
	t.Helper()
	return e.openWith(t, db, e.cfg)
}

// openWith is open with another configuration of the store (its table
// kept).
func (e *env) openWith(t testing.TB, db testenv.DB, cfg parked.Config) handle {
	t.Helper()
	cfg.Table = e.table
	if e.d.pgx {
		return bind(t, sqldb.Pgx(testenv.PgxPool(t)), cfg, e.topic)
	}
	return bind(t, sqldb.Std(db.DB, db.Dialect), cfg, e.topic)
}

// another returns a handle on a pool of its own to the same database.
func (e *env) another(t testing.TB) handle {
	t.Helper()
	if e.d.pgx {
		return e.open(t, e.db)
	}
	if e.db.Dialect == sqldb.SQLite {
		db, err := sql.Open("sqlite", sqlurl.SQLiteDSN(e.sqlite))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return e.open(t, testenv.DB{DB: db, Dialect: sqldb.SQLite})
	}
	return e.open(t, e.d.open(t))
}

func bind[TTx any](t testing.TB, d sqldb.Driver[TTx], cfg parked.Config, topic string) handle {
	t.Helper()
	st, err := parked.New(d, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(d, outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	return handle{api: st, replay: func(ctx context.Context, f parked.Filter, o parked.ReplayOptions) (parked.ReplayResult, error) {
		return st.Replay(ctx, ob, f, o)
	}, relay: ob.NewRelay}
}

// outboxRow is a row of the outbox table.
type outboxRow struct {
	UUID, Topic string
	Payload     []byte
	Metadata    message.Metadata
}

// outboxRows reads every row of the outbox, in offset order.
func (e *env) outboxRows(t testing.TB) []outboxRow {
	t.Helper()
	rows, err := e.db.QueryContext(t.Context(), "SELECT uuid, topic, payload, metadata FROM "+e.q(e.topic)+" ORDER BY "+e.q("offset"))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		var md string
		if err := rows.Scan(&r.UUID, &r.Topic, &r.Payload, &md); err != nil {
			t.Fatal(err)
		}
		if r.Metadata, err = mdcolumn.Decode(md); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// park parks a message of handler with cause, and fails the test if it
// cannot.
func (e *env) park(t testing.TB, p settle.Parked) {
	t.Helper()
	if err := e.Park(t.Context(), p); err != nil {
		t.Fatal(err)
	}
}

// parkedMsg is a Parked of a new message.
func parkedMsg(uuid, handler string, cause error) settle.Parked {
	msg := message.NewMessage(uuid, []byte("payload of "+uuid))
	msg.Metadata.Set("trace", "t-"+uuid)
	return settle.Parked{
		Message: msg, Outcome: settle.DeadLettered, Cause: cause, Handler: handler, Topic: "orders",
		Attempts: 3, FirstFailure: time.Now().Add(-time.Minute), LastFailure: time.Now(),
	}
}

// all lists every row of f, page by page.
func (e *env) all(t testing.TB, f parked.Filter) []parked.Message {
	t.Helper()
	var out []parked.Message
	q := parked.Query{Filter: f, Limit: 7}
	for {
		p, err := e.List(t.Context(), q)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p.Messages...)
		if p.Next == "" {
			return out
		}
		q.Cursor = p.Next
	}
}

// groupsByID returns the groups, by id.
func (e *env) groupsByID(t testing.TB) map[string]parked.Group {
	t.Helper()
	gs, err := e.Groups(t.Context(), parked.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]parked.Group{}
	for _, g := range gs {
		out[g.ID] = g
	}
	return out
}

// checkGroups compares the groups table's counts with the rows.
func (e *env) checkGroups(t testing.TB) {
	t.Helper()
	rows, err := e.db.QueryContext(t.Context(), "SELECT group_id, state, COUNT(*) FROM "+e.q(e.table)+" GROUP BY group_id, state")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	want := map[string][2]int64{}
	for rows.Next() {
		var g, state string
		var n int64
		if err := rows.Scan(&g, &state, &n); err != nil {
			t.Fatal(err)
		}
		c := want[g]
		c[1] += n
		if state == string(parked.StateParked) {
			c[0] += n
		}
		want[g] = c
	}
	got := map[string][2]int64{}
	for id, g := range e.groupsByID(t) {
		got[id] = [2]int64{g.Parked, g.Total}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("group counts (parked, total) = %v; the rows say %v", got, want)
	}
}

var errBoom = errors.New("boom")

func forEach(t *testing.T, fn func(t *testing.T, d drv)) {
	t.Helper()
	for _, d := range drivers() {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			fn(t, d)
		})
	}
}
