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
	"github.com/settle-go/settle/sqldb"
)

// dedupe prune is a dry run without -yes, and refuses a retention below the
// floor without -force; the rows are counted before and after every run, on
// PostgreSQL (pgx and database/sql), MariaDB and SQLite.
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
		{"mariadb", func(t *testing.T) string { return testenv.Require(t, testenv.MySQLURLEnv) }, nil},
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
			quoted := `"` + table + `"`
			if dialect == sqldb.MySQL {
				quoted = "`" + table + "`"
			}

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
				{"recent-confirmed", 2, 0, now.Add(-2 * time.Minute).UnixMicro()},
				{"old-but-live-claim", 1, now.Add(time.Hour).UnixMicro(), old},
			}
			insert := `INSERT INTO ` + quoted + ` (` + map[bool]string{true: "`key`", false: "key"}[dialect == sqldb.MySQL] +
				`, state, token, attempts, expires_at, updated_at) VALUES ($1, $2, 't', 1, $3, $4)`
			if dialect != sqldb.Postgres {
				insert = strings.NewReplacer("$1", "?", "$2", "?", "$3", "?", "$4", "?").Replace(insert)
			}
			for _, r := range rows {
				if _, err := db.ExecContext(t.Context(), insert, []byte(r.key), r.state, r.expires, r.updated); err != nil {
					t.Fatal(err)
				}
			}
			keys := func() []string {
				t.Helper()
				q, err := db.QueryContext(t.Context(), `SELECT `+map[bool]string{true: "`key`", false: "key"}[dialect == sqldb.MySQL]+` FROM `+quoted+` ORDER BY 1`)
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
				return left
			}
			all := keys()
			if len(all) != 6 {
				t.Fatalf("%d rows inserted, want 6", len(all))
			}

			prune := func(args ...string) []string {
				return append(append([]string{"dedupe", "prune", "-db", u, "-table", table}, tc.driver...), args...)
			}
			// Without -yes: what would go, and nothing goes.
			r := mustRun(t, exitOK, prune("-older-than", "7d")...)
			if !strings.Contains(r.stdout, "would delete 4 keys from "+table) || !strings.Contains(r.stdout, "old-confirmed-1") ||
				!strings.Contains(r.stdout, "old-released") || strings.Contains(r.stdout, "recent-confirmed") ||
				!strings.Contains(r.stdout, "dry run: nothing deleted (add -yes to delete)") {
				t.Errorf("dry run:\n%v", r)
			}
			if got := keys(); !slices.Equal(got, all) {
				t.Errorf("the dry run deleted rows: %q left, want %q", got, all)
			}

			// Below the floor: refused, with or without -yes, and the key
			// confirmed two minutes ago still makes its duplicate a
			// duplicate.
			for _, args := range [][]string{{"-older-than", "1m"}, {"-older-than", "1m", "-yes"}, {"-older-than", "23h", "-yes"}} {
				r = mustRun(t, exitUsage, prune(args...)...)
				if !strings.Contains(r.stderr, "is below the floor of 24h") || !strings.Contains(r.stderr, "-force") {
					t.Errorf("%v:\n%v", args, r)
				}
				if got := keys(); !slices.Equal(got, all) {
					t.Fatalf("%v deleted rows: %q left, want %q", args, got, all)
				}
			}
			store, err := dedupe.NewSQLStore(sqldb.Std(db, dialect), dedupe.SQLConfig{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if c, err := store.Claim(t.Context(), "recent-confirmed", time.Minute); err != nil || c.Result != dedupe.Duplicate {
				t.Errorf("a duplicate of the recently confirmed key after the refused prune: %v, %v; want Duplicate", c.Result, err)
			}

			// With -yes: deleted, live claims and recent keys kept.
			r = mustRun(t, exitOK, prune("-older-than", "7d", "-yes")...)
			if !strings.Contains(r.stdout, "pruned 4 rows from "+table+" ") {
				t.Errorf("prune -yes:\n%v", r)
			}
			if got, want := keys(), []string{"old-but-live-claim", "recent-confirmed"}; !slices.Equal(got, want) {
				t.Errorf("rows left: %q, want %q", got, want)
			}
			r = mustRun(t, exitOK, prune("-older-than", "168h", "-yes")...)
			if !strings.HasPrefix(r.stdout, "pruned 0 rows") && !strings.Contains(r.stdout, "\npruned 0 rows") {
				t.Errorf("second prune:\n%v", r)
			}

			// -force goes below the floor, saying so, and still only with -yes.
			r = mustRun(t, exitOK, prune("-older-than", "1m", "-force")...)
			if !strings.Contains(r.stdout, "would delete 1 keys from "+table) || !strings.Contains(r.stderr, "below the floor of 24h") {
				t.Errorf("-force dry run:\n%v", r)
			}
			if got := keys(); len(got) != 2 {
				t.Errorf("-force dry run deleted rows: %q left", got)
			}
			r = mustRun(t, exitOK, prune("-older-than", "1m", "-force", "-yes")...)
			if !strings.Contains(r.stdout, "pruned 1 rows from "+table) {
				t.Errorf("-force -yes:\n%v", r)
			}
			if got, want := keys(), []string{"old-but-live-claim"}; !slices.Equal(got, want) {
				t.Errorf("rows left after -force: %q, want %q", got, want)
			}

			r = mustRun(t, exitFail, append(append([]string{"dedupe", "prune", "-db", u, "-table", table + "_missing"}, tc.driver...), "-older-than", "30d")...)
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
	ob, err := outbox.New(db.Driver(), outbox.Config{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitSchema(t.Context()); err != nil {
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
	r = mustRun(t, exitFail, cmd("outbox", "prune", "-db", u, "-topic", topic+"_none", "-older-than", "30d")...)
	if !strings.Contains(r.stderr, "settle outbox schema -dialect postgres") {
		t.Errorf("prune of a missing outbox:\n%v", r)
	}
	// Forward the two rows, then prune them.
	n, err := ob.Forward(t.Context(), gochannel.NewGoChannel(gochannel.Config{}, nil), outbox.RelayConfig{PollInterval: 5 * time.Millisecond})
	if err != nil || n != 2 {
		t.Fatalf("Forward = %d, %v", n, err)
	}
	r = mustRun(t, exitUsage, cmd("outbox", "prune", "-db", u, "-topic", topic)...)
	if !strings.Contains(r.stderr, "-older-than is required") {
		t.Errorf("prune without -older-than:\n%v", r)
	}
	r = mustRun(t, exitOK, cmd("outbox", "prune", "-db", u, "-topic", topic, "-older-than", "1ns", "-force", "-yes")...)
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
		if got, want := d.driver, map[bool]string{true: driverPgx, false: driverSQL}[tc.pgx]; got != want {
			t.Errorf("%s -driver %s: on %s, want %s", redact(tc.url), tc.driver, got, want)
		}
		if err := d.pool.Alive(t.Context()); err != nil {
			t.Errorf("%s -driver %s: %v", redact(tc.url), tc.driver, err)
		}
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	}
}

// outbox prune is a dry run without -yes and refuses a retention below the
// floor without -force; the rows are counted before and after every run, on
// PostgreSQL (pgx and database/sql), MariaDB and SQLite.
func TestOutboxPrune(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		open   func(t *testing.T) (testenv.DB, string)
		driver []string
	}{
		{"postgres-pgx", func(t *testing.T) (testenv.DB, string) {
			return testenv.Postgres(t), testenv.Require(t, testenv.PostgresURLEnv)
		}, nil},
		{"postgres-sql", func(t *testing.T) (testenv.DB, string) {
			return testenv.Postgres(t), testenv.Require(t, testenv.PostgresURLEnv)
		}, []string{"-driver", "sql"}},
		{"mariadb", func(t *testing.T) (testenv.DB, string) {
			return testenv.MySQL(t), testenv.Require(t, testenv.MySQLURLEnv)
		}, nil},
		{"sqlite", func(t *testing.T) (testenv.DB, string) {
			path := filepath.Join(t.TempDir(), "settle.db")
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			u := "sqlite://" + path
			db, dialect, err := openDB(&env{ctx: t.Context(), getenv: func(string) string { return "" }}, u)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			return testenv.DB{DB: db, Dialect: dialect}, u
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, u := tc.open(t)
			var b [4]byte
			_, _ = rand.Read(b[:])
			topic := "cli_prune_" + hex.EncodeToString(b[:])
			ob, err := outbox.New(db.Driver(), outbox.Config{Topic: topic})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.InitSchema(t.Context()); err != nil {
				t.Fatal(err)
			}
			q := func(s string) string {
				if db.Dialect == sqldb.MySQL {
					return strings.ReplaceAll(s, `"`, "`")
				}
				return s
			}
			t.Cleanup(func() {
				for _, tbl := range []string{topic, topic + "_relays"} {
					_, _ = db.ExecContext(context.Background(), q(`DROP TABLE IF EXISTS "`+tbl+`"`))
				}
			})
			tx, err := db.BeginTx(t.Context(), nil)
			if err != nil {
				t.Fatal(err)
			}
			pub, err := ob.TxPublisher(tx)
			if err != nil {
				t.Fatal(err)
			}
			for range 4 {
				if err := pub.Publish("orders", message.NewMessage(testenv.Name(t, "m"), []byte("{}"))); err != nil {
					t.Fatal(err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			// Three rows forwarded, two of them two days ago; one pending.
			ch := gochannel.NewGoChannel(gochannel.Config{}, nil)
			defer ch.Close()
			if n, err := ob.Forward(t.Context(), ch, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, BatchSize: 3}); err != nil || n < 3 {
				t.Fatalf("Forward = %d, %v", n, err)
			}
			back := map[sqldb.Dialect]string{
				sqldb.Postgres: `UPDATE "` + topic + `" SET "forwarded_at" = "forwarded_at" - INTERVAL '48 hours' WHERE "offset" IN (SELECT "offset" FROM "` + topic + `" WHERE "forwarded_at" IS NOT NULL ORDER BY "offset" LIMIT 2)`,
				sqldb.MySQL:    "UPDATE `" + topic + "` SET forwarded_at = forwarded_at - INTERVAL 48 HOUR WHERE forwarded_at IS NOT NULL ORDER BY `offset` LIMIT 2",
				sqldb.SQLite:   `UPDATE "` + topic + `" SET "forwarded_at" = strftime('%Y-%m-%d %H:%M:%f', "forwarded_at", '-48 hours') WHERE "offset" IN (SELECT "offset" FROM "` + topic + `" WHERE "forwarded_at" IS NOT NULL ORDER BY "offset" LIMIT 2)`,
			}[db.Dialect]
			if _, err := db.ExecContext(t.Context(), back); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(t.Context(), q(`UPDATE "`+topic+`" SET "forwarded_at" = NULL WHERE "offset" = (SELECT m FROM (SELECT MAX("offset") AS m FROM "`+topic+`") AS x)`)); err != nil {
				t.Fatal(err)
			}
			count := func() (all, pending int) {
				t.Helper()
				if err := db.QueryRowContext(t.Context(), q(`SELECT COUNT(*), COUNT(*) - COUNT("forwarded_at") FROM "`+topic+`"`)).Scan(&all, &pending); err != nil {
					t.Fatal(err)
				}
				return all, pending
			}
			if all, pending := count(); all != 4 || pending != 1 {
				t.Fatalf("%d rows, %d pending; want 4 and 1", all, pending)
			}
			prune := func(args ...string) []string {
				return append(append([]string{"outbox", "prune", "-db", u, "-topic", topic}, tc.driver...), args...)
			}
			r := mustRun(t, exitOK, prune("-older-than", "1d")...)
			if !strings.Contains(r.stdout, "would delete 2 rows from outbox "+topic) || strings.Count(r.stdout, "orders") != 2 ||
				!strings.Contains(r.stdout, "dry run: nothing deleted") {
				t.Errorf("dry run:\n%v", r)
			}
			if all, _ := count(); all != 4 {
				t.Errorf("the dry run deleted rows: %d left", all)
			}
			for _, args := range [][]string{{"-older-than", "1h"}, {"-older-than", "1h", "-yes"}} {
				r = mustRun(t, exitUsage, prune(args...)...)
				if !strings.Contains(r.stderr, "is below the floor of 24h") {
					t.Errorf("%v:\n%v", args, r)
				}
				if all, _ := count(); all != 4 {
					t.Fatalf("%v deleted rows: %d left", args, all)
				}
			}
			r = mustRun(t, exitOK, prune("-older-than", "1d", "-yes")...)
			if !strings.Contains(r.stdout, "pruned 2 rows from outbox "+topic) {
				t.Errorf("prune -yes:\n%v", r)
			}
			if all, pending := count(); all != 2 || pending != 1 {
				t.Errorf("after prune -yes: %d rows, %d pending; want 2 and 1", all, pending)
			}
			r = mustRun(t, exitOK, prune("-older-than", "1ns", "-force", "-yes")...)
			if !strings.Contains(r.stdout, "pruned 1 rows") || !strings.Contains(r.stderr, "below the floor") {
				t.Errorf("prune -force -yes:\n%v", r)
			}
			if all, pending := count(); all != 1 || pending != 1 {
				t.Errorf("after prune -force: %d rows, %d pending; want the pending row only", all, pending)
			}
		})
	}
}
