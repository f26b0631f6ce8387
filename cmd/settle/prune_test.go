package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// pruneDatabases are the databases the prune commands are tried on, with
// the -driver flag of each.
func pruneDatabases() []struct {
	name   string
	url    func(t *testing.T) string
	driver []string
} {
	pg := func(t *testing.T) string { return testenv.Require(t, testenv.PostgresURLEnv) }
	return []struct {
		name   string
		url    func(t *testing.T) string
		driver []string
	}{
		{"postgres-pgx", pg, nil},
		{"postgres-sql", pg, []string{"-driver", "sql"}},
		{"mariadb", func(t *testing.T) string { return testenv.Require(t, testenv.MySQLURLEnv) }, nil},
		{"sqlite", func(t *testing.T) string {
			path := filepath.Join(t.TempDir(), "settle.db")
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			return "sqlite://" + path
		}, nil},
	}
}

// openTestDB opens u as the command does.
func openTestDB(t *testing.T, u string) (*sql.DB, string) {
	t.Helper()
	db, dialect, err := openDB(&env{ctx: t.Context(), getenv: func(string) string { return "" }}, u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db, string(dialect)
}

// createFromSchema runs the statements a schema command prints.
func createFromSchema(t *testing.T, db *sql.DB, args ...string) {
	t.Helper()
	r := mustRun(t, exitOK, args...)
	for _, g := range strings.Split(strings.TrimSpace(r.stdout), "\n\n")[1:] {
		if _, err := db.ExecContext(t.Context(), strings.TrimSuffix(g, ";")); err != nil {
			t.Fatalf("%s: %v", g, err)
		}
	}
}

var (
	wouldDelete = regexp.MustCompile(`would delete (\d+) (?:keys|rows) from `)
	sampleLine  = regexp.MustCompile(`(?m)^  (\S+)  `)
)

// dryRun runs a prune without -yes and returns the count it announced and
// the first column of the rows it showed.
func dryRun(t *testing.T, args ...string) (int, []string) {
	t.Helper()
	r := mustRun(t, exitOK, args...)
	m := wouldDelete.FindStringSubmatch(r.stdout)
	if m == nil || !strings.Contains(r.stdout, "dry run: nothing deleted") {
		t.Fatalf("dry run:\n%v", r)
	}
	n, _ := strconv.Atoi(m[1])
	var shown []string
	for _, s := range sampleLine.FindAllStringSubmatch(r.stdout, -1) {
		if s[1] != "KEY" && s[1] != "UUID" {
			shown = append(shown, s[1])
		}
	}
	slices.Sort(shown)
	return n, shown
}

// The dry run of a prune shows the rows the prune then deletes: as many,
// and the same ones, whatever the filter of the library's prune is. Rows
// on every side of the filter, fewer deleted than the dry run shows, on
// every database and driver.
func TestPrunePreviewIsWhatPruneDeletes(t *testing.T) {
	t.Parallel()
	for _, tc := range pruneDatabases() {
		t.Run("dedupe-"+tc.name, func(t *testing.T) {
			t.Parallel()
			u := tc.url(t)
			db, dialect := openTestDB(t, u)
			table := shortName("cli_pvd_")
			createFromSchema(t, db, "dedupe", "schema", "-dialect", dialect, "-table", table)
			q, key, ph := `"`+table+`"`, "key", "$1, $2, 't', 1, $3, $4"
			if dialect == "mysql" {
				q, key = "`"+table+"`", "`key`"
			}
			if dialect != "postgres" {
				ph = "?, ?, 't', 1, ?, ?"
			}
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+q) })
			now := time.Now()
			ago := func(d time.Duration) int64 { return now.Add(-d).UnixMicro() }
			const day = 24 * time.Hour
			for _, r := range []struct {
				key              string
				state            int
				expires, updated int64
			}{
				{"confirmed-old", 2, 0, ago(200 * time.Hour)},
				{"confirmed-8d", 2, 0, ago(8 * day)},
				{"confirmed-6d", 2, 0, ago(6 * day)},
				{"confirmed-now", 2, 0, ago(time.Minute)},
				{"released-old", 0, 0, ago(200 * time.Hour)},
				{"released-6d", 0, 0, ago(6 * day)},
				{"claim-expired-8d", 1, ago(8 * day), ago(9 * day)},
				{"claim-expired-1h", 1, ago(time.Hour), ago(9 * day)},
				{"claim-live-old", 1, now.Add(time.Hour).UnixMicro(), ago(9 * day)},
				{"claim-live-now", 1, now.Add(time.Hour).UnixMicro(), ago(time.Second)},
			} {
				if _, err := db.ExecContext(t.Context(), `INSERT INTO `+q+` (`+key+`, state, token, attempts, expires_at, updated_at) VALUES (`+ph+`)`,
					[]byte(r.key), r.state, r.expires, r.updated); err != nil {
					t.Fatal(err)
				}
			}
			keys := func() []string {
				t.Helper()
				rows, err := db.QueryContext(t.Context(), `SELECT `+key+` FROM `+q)
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				var ks []string
				for rows.Next() {
					var k []byte
					if err := rows.Scan(&k); err != nil {
						t.Fatal(err)
					}
					ks = append(ks, string(k))
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				slices.Sort(ks)
				return ks
			}
			prune := append(append([]string{"dedupe", "prune", "-db", u, "-table", table}, tc.driver...), "-older-than", "7d")
			before := keys()
			n, shown := dryRun(t, prune...)
			mustRun(t, exitOK, append(prune, "-yes")...)
			deleted := deletedOf(before, keys())
			if n != len(deleted) || !slices.Equal(shown, deleted) {
				t.Errorf("the dry run would delete %d keys, showing %q; the prune deleted %q", n, shown, deleted)
			}
			if len(deleted) == 0 || len(deleted) > pruneSample {
				t.Errorf("the prune deleted %q: the test wants some keys deleted, at most %d, all of them shown", deleted, pruneSample)
			}
		})
		t.Run("outbox-"+tc.name, func(t *testing.T) {
			t.Parallel()
			u := tc.url(t)
			db, dialect := openTestDB(t, u)
			topic := shortName("cli_pvo_")
			createFromSchema(t, db, "outbox", "schema", "-dialect", dialect, "-topic", topic)
			quote := func(s string) string {
				if dialect == "mysql" {
					return strings.ReplaceAll(s, `"`, "`")
				}
				return s
			}
			t.Cleanup(func() {
				for _, tbl := range []string{topic, topic + "_relays"} {
					_, _ = db.ExecContext(context.Background(), quote(`DROP TABLE IF EXISTS "`+tbl+`"`))
				}
			})
			// ago(h) is the database's clock h hours ago, as the relay
			// stamps forwarded_at.
			ago := func(h int) string {
				switch dialect {
				case "postgres":
					return "clock_timestamp() - INTERVAL '" + strconv.Itoa(h) + " hours'"
				case "mysql":
					return "CURRENT_TIMESTAMP(6) - INTERVAL " + strconv.Itoa(h) + " HOUR"
				}
				return "strftime('%Y-%m-%d %H:%M:%f', 'now', '-" + strconv.Itoa(h) + " hours')"
			}
			for _, r := range []struct{ uuid, forwarded, setAside string }{
				{"fwd-200h", ago(200), "NULL"},
				{"fwd-48h", ago(48), "NULL"},
				{"fwd-25h", ago(25), "NULL"},
				{"fwd-23h", ago(23), "NULL"},
				{"fwd-now", ago(0), "NULL"},
				{"pending", "NULL", "NULL"},
				{"aside-48h", "NULL", ago(48)},
			} {
				if _, err := db.ExecContext(t.Context(), quote(`INSERT INTO "`+topic+`" ("uuid", "topic", "payload", "metadata", "forwarded_at", "set_aside_at")
VALUES ('`+r.uuid+`', 'orders', '', '{}', `+r.forwarded+`, `+r.setAside+`)`)); err != nil {
					t.Fatal(err)
				}
			}
			uuids := func() []string {
				t.Helper()
				rows, err := db.QueryContext(t.Context(), quote(`SELECT "uuid" FROM "`+topic+`"`))
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				var us []string
				for rows.Next() {
					var u string
					if err := rows.Scan(&u); err != nil {
						t.Fatal(err)
					}
					us = append(us, u)
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				slices.Sort(us)
				return us
			}
			prune := append(append([]string{"outbox", "prune", "-db", u, "-topic", topic}, tc.driver...), "-older-than", "1d")
			before := uuids()
			n, shown := dryRun(t, prune...)
			mustRun(t, exitOK, append(prune, "-yes")...)
			deleted := deletedOf(before, uuids())
			if n != len(deleted) || !slices.Equal(shown, deleted) {
				t.Errorf("the dry run would delete %d rows, showing %q; the prune deleted %q", n, shown, deleted)
			}
			if len(deleted) == 0 || len(deleted) > pruneSample {
				t.Errorf("the prune deleted %q: the test wants some rows deleted, at most %d, all of them shown", deleted, pruneSample)
			}
		})
	}
}

// shortName is prefix and 8 random hex digits: a table name short enough
// for an outbox topic.
func shortName(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// deletedOf returns the elements of before (sorted) missing from after.
func deletedOf(before, after []string) []string {
	var gone []string
	for _, b := range before {
		if !slices.Contains(after, b) {
			gone = append(gone, b)
		}
	}
	return gone
}

// On a partitioned claims table (the schema from `dedupe schema
// -partition`) `dedupe prune -partition` shows what it would delete and
// deletes nothing without -yes; with -yes it drops the partitions past the
// cutoff, and the keys in them are gone, while a recent key stays.
func TestDedupePrunePartitioned(t *testing.T) {
	t.Parallel()
	for _, tc := range pruneDatabases()[:3] {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			u := tc.url(t)
			db, dialect := openTestDB(t, u)
			table := shortName("cli_pp_")
			createFromSchema(t, db, "dedupe", "schema", "-dialect", dialect, "-table", table, "-partition", "24h")
			q, key, ph := `"`+table+`"`, "key", "$1, 2, '', 1, 0, $2, $2"
			if dialect == "mysql" {
				q, key, ph = "`"+table+"`", "`key`", "?, 2, '', 1, 0, ?, ?"
			}
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+q) })
			var partitioned int
			pq := `SELECT count(*) FROM pg_partitioned_table WHERE partrelid = '` + q + `'::regclass`
			if dialect == "mysql" {
				pq = `SELECT count(*) FROM information_schema.PARTITIONS WHERE table_schema = DATABASE() AND table_name = '` + table + `' AND partition_name IS NOT NULL`
			}
			if err := db.QueryRowContext(t.Context(), pq).Scan(&partitioned); err != nil || partitioned == 0 {
				t.Fatalf("the table from dedupe schema -partition is not partitioned: %d, %v", partitioned, err)
			}
			r := mustRun(t, exitOK, append(append([]string{"dedupe", "prune", "-db", u, "-table", table}, tc.driver...), "-partition", "24h", "-older-than", "7d")...)
			if !strings.Contains(r.stdout, "would delete 0 keys") {
				t.Fatalf("dry run on an empty table:\n%v", r)
			}
			old, recent := time.Now().Add(-9*24*time.Hour).UnixMicro(), time.Now().Add(-time.Hour).UnixMicro()
			// The partitions of the last ten days, as a migration makes them
			// (a dry run makes none).
			store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.Dialect(dialect)), dedupe.SQLConfig{Table: table, Partition: 24 * time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			if err := store.AddPartitions(t.Context(), time.UnixMicro(old), time.Now()); err != nil {
				t.Fatal(err)
			}
			for k, at := range map[string]int64{"old": old, "recent": recent} {
				args := []any{[]byte(k), at, at}
				if dialect == "postgres" {
					args = args[:2]
				}
				if _, err := db.ExecContext(t.Context(), `INSERT INTO `+q+` (`+key+`, state, token, attempts, expires_at, updated_at, until_at) VALUES (`+ph+`)`, args...); err != nil {
					t.Fatalf("insert %s: %v", k, err)
				}
			}
			count := func() (n int) {
				t.Helper()
				if err := db.QueryRowContext(t.Context(), `SELECT count(*) FROM `+q).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			prune := append(append([]string{"dedupe", "prune", "-db", u, "-table", table}, tc.driver...), "-partition", "24h", "-older-than", "7d")
			if n, shown := dryRun(t, prune...); n != 1 || !slices.Equal(shown, []string{"old"}) || count() != 2 {
				t.Fatalf("dry run: would delete %d %v, %d rows left; want 1 [old], 2 rows", n, shown, count())
			}
			r = mustRun(t, exitOK, append(prune, "-yes")...)
			if !strings.Contains(r.stdout, "pruned about") || !strings.Contains(r.stdout, "estimate") {
				t.Fatalf("prune -yes:\n%v", r)
			}
			var left []byte
			if err := db.QueryRowContext(t.Context(), `SELECT `+key+` FROM `+q).Scan(&left); err != nil || string(left) != "recent" || count() != 1 {
				t.Fatalf("after the prune: %q (%v), %d rows; want only recent", left, err, count())
			}
		})
	}
}
