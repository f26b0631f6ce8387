package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

func TestDedupePrune(t *testing.T) {
	t.Parallel()
	pg := func(t *testing.T) string { return testenv.Require(t, testenv.PostgresURLEnv) }
	for _, tc := range []struct {
		name   string
		url    func(t *testing.T) string
		driver []string // the -driver flag, if any
	}{
		{"postgres-pgx", pg, nil}, // pgx is the default for postgres://
		{"postgres-sql", pg, []string{"-driver", "sql"}},
		{"sqlite", func(t *testing.T) string {
			// The command opens only an existing file: an empty one is an
			// empty SQLite database.
			path := filepath.Join(t.TempDir(), "settle.db")
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			return "sqlite://" + path
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			u := tc.url(t)
			db, dialect, err := openDB(&env{ctx: t.Context(), getenv: func(string) string { return "" }}, u)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			tdb := testenv.DB{DB: db, Dialect: dialect}
			table := testenv.DedupeTable(t, tdb)

			now := time.Now()
			old := now.Add(-200 * time.Hour).UnixMicro()
			rows := []struct {
				key              string
				state            int
				expires, updated int64
			}{
				{"old-confirmed-1", 2, 0, old},
				{"old-confirmed-2", 2, 0, old},
				{"old-confirmed-3", 2, 0, old},
				{"old-released", 0, 0, old},
				{"recent-confirmed", 2, 0, now.UnixMicro()},
				{"old-but-live-claim", 1, now.Add(time.Hour).UnixMicro(), old},
			}
			insert := `INSERT INTO "` + table + `" (key, state, token, attempts, expires_at, updated_at) VALUES ($1, $2, 't', 1, $3, $4)`
			if dialect == dedupe.SQLite {
				insert = strings.NewReplacer("$1", "?", "$2", "?", "$3", "?", "$4", "?").Replace(insert)
			}
			for _, r := range rows {
				if _, err := db.ExecContext(t.Context(), insert, []byte(r.key), r.state, r.expires, r.updated); err != nil {
					t.Fatal(err)
				}
			}

			prune := func(args ...string) []string {
				return append(append([]string{"dedupe", "prune", "-db", u}, tc.driver...), args...)
			}
			r := mustRun(t, exitOK, prune("-table", table, "-older-than", "7d")...)
			if !strings.HasPrefix(r.stdout, "pruned 4 rows from "+table+" ") {
				t.Errorf("prune output:\n%v", r)
			}
			q, err := db.QueryContext(t.Context(), `SELECT key FROM "`+table+`" ORDER BY key`)
			if err != nil {
				t.Fatal(err)
			}
			defer q.Close()
			var left []string
			for q.Next() {
				var k []byte
				if err := q.Scan(&k); err != nil {
					t.Fatal(err)
				}
				left = append(left, string(k))
			}
			if err := q.Err(); err != nil {
				t.Fatal(err)
			}
			if want := []string{"old-but-live-claim", "recent-confirmed"}; !slices.Equal(left, want) {
				t.Errorf("rows left: %q, want %q", left, want)
			}

			r = mustRun(t, exitOK, prune("-table", table, "-older-than", "168h")...)
			if !strings.HasPrefix(r.stdout, "pruned 0 rows") {
				t.Errorf("second prune:\n%v", r)
			}
			r = mustRun(t, exitFail, prune("-table", table+"_missing", "-older-than", "1h")...)
			if !strings.Contains(r.stderr, "settle: prune "+table+"_missing") {
				t.Errorf("prune of a missing table:\n%v", r)
			}
		})
	}
}

// outbox status and prune on PostgreSQL, through pgx (the default) and
// through database/sql (-driver sql).
func TestOutboxStatus(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "sql"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			testOutboxStatus(t, driver)
		})
	}
}

func testOutboxStatus(t *testing.T, driver string) {
	u := testenv.Require(t, testenv.PostgresURLEnv)
	db := testenv.Postgres(t)
	var b [4]byte
	_, _ = rand.Read(b[:])
	topic := "cli_status_" + hex.EncodeToString(b[:])
	ob, err := outbox.New(outbox.Config{Dialect: dedupe.Postgres, Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context(), db.DB); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, tbl := range []string{topic, topic + "_relays"} {
			_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+tbl+`"`)
		}
	})

	// -driver is given for sql only: pgx is the default.
	cmd := func(args ...string) []string {
		if driver == "sql" {
			args = append(args[:2:2], append([]string{"-driver", "sql"}, args[2:]...)...)
		}
		return args
	}
	r := mustRun(t, exitOK, cmd("outbox", "status", "-db", u, "-topic", topic)...)
	if !strings.Contains(r.stdout, "state:   ok\n") || !strings.Contains(r.stdout, "pending: 0\n") || !strings.Contains(r.stdout, "lag:     0s\n") {
		t.Errorf("status of an empty outbox:\n%v", r)
	}

	publish := func(commit bool, n int) {
		tx, err := db.BeginTx(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := ob.TxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		for range n {
			if err := pub.Publish("orders", message.NewMessage(testenv.Name(t, "m"), []byte("{}"))); err != nil {
				t.Fatal(err)
			}
		}
		if commit {
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		} else if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
	}
	publish(true, 2)
	publish(false, 5)

	r = mustRun(t, exitOK, cmd("outbox", "status", "-db", u, "-topic", topic, "-json")...)
	var st struct {
		Topic      string  `json:"topic"`
		State      string  `json:"state"`
		Pending    int64   `json:"pending"`
		LagSeconds float64 `json:"lag_seconds"`
		LiveRelays int64   `json:"live_relays"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil {
		t.Fatalf("status -json: %v\n%v", err, r)
	}
	if st.Topic != topic || st.State != "ok" || st.Pending != 2 || st.LagSeconds < 0 || st.LagSeconds > 60 {
		t.Errorf("status = %+v, want 2 pending", st)
	}
	// Consumer groups are gone: the flag is refused, not ignored.
	r = mustRun(t, exitUsage, cmd("outbox", "status", "-db", u, "-topic", topic, "-group", "nosuch")...)
	if !strings.Contains(r.stderr, "-group") {
		t.Errorf("status -group:\n%v", r)
	}
	// Old rows and no relay: the status says so and exits 1.
	time.Sleep(20 * time.Millisecond)
	r = mustRun(t, exitFail, cmd("outbox", "status", "-db", u, "-topic", topic, "-stuck-after", "10ms")...)
	if !strings.Contains(r.stdout, "state:   no_relay\n") || !strings.Contains(r.stdout, "no relay is alive") {
		t.Errorf("status of old rows without a relay:\n%v", r)
	}

	// A missing outbox: the hint says what to run, not the driver's error.
	r = mustRun(t, exitFail, cmd("outbox", "status", "-db", u, "-topic", topic+"_none")...)
	if !strings.Contains(r.stderr, "table "+topic+"_none does not exist") || !strings.Contains(r.stderr, "settle outbox schema -dialect postgres -topic "+topic+"_none") {
		t.Errorf("status of a missing outbox:\n%v", r)
	}
	r = mustRun(t, exitFail, cmd("outbox", "prune", "-db", u, "-topic", topic+"_none", "-older-than", "1h")...)
	if !strings.Contains(r.stderr, "settle outbox schema -dialect postgres") {
		t.Errorf("prune of a missing outbox:\n%v", r)
	}
	// Forward the two rows, then prune them.
	n, err := ob.Forward(t.Context(), db.DB, gochannel.NewGoChannel(gochannel.Config{}, nil), outbox.RelayConfig{PollInterval: 5 * time.Millisecond})
	if err != nil || n != 2 {
		t.Fatalf("Forward = %d, %v", n, err)
	}
	r = mustRun(t, exitUsage, cmd("outbox", "prune", "-db", u, "-topic", topic)...)
	if !strings.Contains(r.stderr, "-older-than is required") {
		t.Errorf("prune without -older-than:\n%v", r)
	}
	r = mustRun(t, exitOK, cmd("outbox", "prune", "-db", u, "-topic", topic, "-older-than", "1ns")...)
	if !strings.Contains(r.stdout, "pruned 2 rows from outbox "+topic) {
		t.Errorf("prune:\n%v", r)
	}
	var rows int
	if err := db.QueryRowContext(t.Context(), `SELECT COUNT(*) FROM "`+topic+`"`).Scan(&rows); err != nil || rows != 0 {
		t.Errorf("%d rows left after prune, %v; want 0", rows, err)
	}
}

// A SQLite URL naming a file that does not exist is refused, and the file is
// not created: opening it would make an empty database.
func TestMissingSQLiteFileIsNotCreated(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "missing.db")
	for _, args := range [][]string{
		{"outbox", "status", "-db", "sqlite://" + path},
		{"dedupe", "prune", "-db", "sqlite://" + path, "-older-than", "7d"},
	} {
		r := mustRun(t, exitFail, args...)
		if !strings.Contains(r.stderr, "no SQLite database at "+path) {
			t.Errorf("%v:\n%v", args, r)
		}
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Fatalf("%v created %s (stat: %v)", args, path, err)
		}
	}
}

// -driver picks how the database commands reach PostgreSQL: a pgx pool by
// default, database/sql when asked; SQLite has database/sql only.
func TestDatabaseDriver(t *testing.T) {
	t.Parallel()
	u := testenv.Require(t, testenv.PostgresURLEnv)
	path := filepath.Join(t.TempDir(), "settle.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e := &env{ctx: t.Context(), getenv: func(string) string { return "" }}
	for _, tc := range []struct {
		url, driver string
		pgx         bool
	}{
		{u, driverAuto, true},
		{u, driverPgx, true},
		{u, driverSQL, false},
		{"sqlite://" + path, driverAuto, false},
		{"sqlite://" + path, driverSQL, false},
	} {
		d, err := openDatabase(e, tc.url, tc.driver)
		if err != nil {
			t.Fatalf("%s -driver %s: %v", redact(tc.url), tc.driver, err)
		}
		if (d.pool != nil) != tc.pgx {
			t.Errorf("%s -driver %s: on a pgx pool = %v, want %v", redact(tc.url), tc.driver, d.pool != nil, tc.pgx)
		}
		// The one handle answers: on pgx there is no database/sql pool.
		if d.pool != nil {
			if d.db != nil {
				t.Errorf("%s -driver %s: a database/sql handle beside the pgx pool", redact(tc.url), tc.driver)
			}
			if err := d.pool.Ping(t.Context()); err != nil {
				t.Error(err)
			}
		} else if err := d.db.PingContext(t.Context()); err != nil {
			t.Errorf("%s -driver %s: %v", redact(tc.url), tc.driver, err)
		}
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	}
}
