package main

import (
	"bytes"
	"database/sql"
	"flag"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

func TestRunUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"no arguments", nil, "usage:"},
		{"unknown group", []string{"queue", "list"}, `unknown command "queue list"`},
		{"unknown subcommand", []string{"dlq", "frob"}, `unknown command "dlq frob"`},
		{"group only", []string{"dlq"}, "settle dlq: which command?"},
		{"list without queue", []string{"dlq", "list"}, "-queue is required"},
		{"list with argument", []string{"dlq", "list", "-queue", "q", "extra"}, `unexpected argument "extra"`},
		{"list negative limit", []string{"dlq", "list", "-queue", "q", "-limit", "-1"}, "-limit must be >= 0"},
		{"bad flag", []string{"dlq", "list", "-frob"}, "flag provided but not defined: -frob"},
		{"show without id", []string{"dlq", "show", "-queue", "q"}, "want exactly one message UUID"},
		{"show two ids", []string{"dlq", "show", "-queue", "q", "a", "b"}, "want exactly one message UUID"},
		{"replay without selection", []string{"dlq", "replay", "-queue", "q"}, "choose messages with -id, -handler or -reason, or pass -all"},
		{"replay all and filter", []string{"dlq", "replay", "-queue", "q", "-all", "-handler", "h"}, "-all cannot be combined"},
		{"replay to itself", []string{"dlq", "replay", "-queue", "q", "-all", "-to", "q"}, "-to is the queue being replayed"},
		{"prune without older-than", []string{"dedupe", "prune", "-db", "sqlite://x.db"}, "-older-than is required"},
		{"prune bad duration", []string{"dedupe", "prune", "-older-than", "a week"}, "invalid value"},
		{"prune bad days", []string{"dedupe", "prune", "-older-than", "7days"}, "after the days, want a duration"},
		{"db unsupported scheme", []string{"dedupe", "prune", "-db", "oracle://h/db", "-older-than", "30d"}, `-db: unsupported scheme "oracle"`},
		{"db not a URL", []string{"outbox", "status", "-db", "just-a-name"}, "-db: "},
		{"driver pgx on sqlite", []string{"outbox", "status", "-db", "sqlite://x.db", "-driver", "pgx"}, "-driver pgx works with postgres:// only, and -db is sqlite"},
		{"driver unknown", []string{"dedupe", "prune", "-db", "sqlite://x.db", "-driver", "odbc", "-older-than", "30d"}, `-driver: "odbc" is not pgx, sql or auto`},
		{"db missing", []string{"outbox", "status"}, "-db: no database URL (set -db, SETTLE_POSTGRES_URL or SETTLE_MYSQL_URL)"},
		{"amqp missing", []string{"dlq", "list", "-queue", "q"}, "-amqp: no broker URL (set -amqp or SETTLE_AMQP_URL)"},
		{"amqp bad scheme", []string{"dlq", "list", "-queue", "q", "-amqp", "http://h/"}, "-amqp: "},
		{"amqp host and port only", []string{"dlq", "list", "-queue", "q", "-amqp", "localhost:5672"}, "want amqp://user:password@host:5672/"},
		{"dedupe schema without dialect", []string{"dedupe", "schema"}, "-dialect is required"},
		{"dedupe schema bad dialect", []string{"dedupe", "schema", "-dialect", "oracle"}, `unknown dialect "oracle"`},
		{"dedupe schema bad table", []string{"dedupe", "schema", "-dialect", "sqlite", "-table", "a;b"}, "not a valid identifier"},
		{"outbox schema bad topic", []string{"outbox", "schema", "-dialect", "mysql", "-topic", "a b"}, "Config.Topic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := mustRun(t, exitUsage, tc.args...)
			if !strings.Contains(r.stderr, tc.stderr) {
				t.Errorf("stderr lacks %q:\n%v", tc.stderr, r)
			}
			if r.stdout != "" {
				t.Errorf("usage error wrote to stdout:\n%v", r)
			}
			if len(tc.args) >= 2 && !strings.Contains(r.stderr, "usage: settle ") && !strings.Contains(r.stderr, "usage:\n") {
				t.Errorf("no usage printed:\n%v", r)
			}
		})
	}
}

func TestRunHelp(t *testing.T) {
	t.Parallel()
	r := mustRun(t, exitOK, "help")
	for _, c := range commands {
		if !strings.Contains(r.stdout, "settle "+synopses[c.name]) {
			t.Errorf("usage lacks %q:\n%s", c.name, r.stdout)
		}
	}
	r = mustRun(t, exitOK, "dlq", "replay", "-h")
	for _, f := range []string{"-yes", "-handler", "-reason", "-id", "-all", "-progress"} {
		if !strings.Contains(r.stdout, f) {
			t.Errorf("replay -h lacks %s:\n%s", f, r.stdout)
		}
	}
}

// "settle dlq --help" and its spellings show the group's commands.
func TestGroupHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"dlq", "--help"}, {"dlq", "-h"}, {"dlq", "help"}, {"help", "dlq"}} {
		r := mustRun(t, exitOK, args...)
		if !strings.Contains(r.stdout, "settle dlq replay -queue Q") || strings.Contains(r.stdout, "settle dedupe") || r.stderr != "" {
			t.Errorf("%v: want the dlq commands only on stdout:\n%v", args, r)
		}
	}
	r := mustRun(t, exitOK, "outbox", "--help")
	if !strings.Contains(r.stdout, "settle outbox status") || strings.Contains(r.stdout, "settle dlq") {
		t.Errorf("outbox --help:\n%v", r)
	}
}

func TestParseAge(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"7d": 7 * 24 * time.Hour, "1d12h": 36 * time.Hour, "168h": 168 * time.Hour, "90m": 90 * time.Minute, "0d": 0,
	} {
		if got, err := parseAge(in); err != nil || got != want {
			t.Errorf("parseAge(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"d", "7days", "x7d", "-1d", "1d-2h", "1w", ""} {
		if got, err := parseAge(in); err == nil {
			t.Errorf("parseAge(%q) = %v; want an error", in, got)
		}
	}
}

func TestRunConnectionErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		vars   map[string]string
		args   []string
		stderr string
	}{
		{"db from environment", map[string]string{"SETTLE_POSTGRES_URL": "postgres://u:secret@127.0.0.1:1/db?sslmode=disable"},
			[]string{"outbox", "status"}, "settle: $SETTLE_POSTGRES_URL: cannot reach the postgres database at postgres://u:xxxxx@127.0.0.1:1/db"},
		{"db from the second variable", map[string]string{"SETTLE_MYSQL_URL": "mysql://u:secret@127.0.0.1:1/db"},
			[]string{"outbox", "status"}, "settle: $SETTLE_MYSQL_URL: cannot reach the mysql database"},
		{"db unreachable", nil, []string{"outbox", "status", "-db", "postgres://u:secret@127.0.0.1:1/db?sslmode=disable"},
			"settle: -db: cannot reach the postgres database at postgres://u:xxxxx@127.0.0.1:1/db"},
		{"amqp unreachable", nil, []string{"dlq", "list", "-queue", "q", "-amqp", "amqp://guest:guest@127.0.0.1:1/"},
			"settle: -amqp: cannot connect to the broker at 127.0.0.1:1"},
		{"amqp from environment", map[string]string{"SETTLE_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/"},
			[]string{"dlq", "replay", "-queue", "q", "-all"}, "cannot connect to the broker at 127.0.0.1:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := runCmd(t.Context(), tc.vars, tc.args...)
			if r.code != exitFail || !strings.Contains(r.stderr, tc.stderr) {
				t.Errorf("want exit 1 and %q, got\n%v", tc.stderr, r)
			}
			if strings.Contains(r.stderr, "secret") {
				t.Errorf("password printed:\n%v", r)
			}
		})
	}
}

func TestHelpHidesEnvironmentURL(t *testing.T) {
	t.Parallel()
	vars := map[string]string{envAMQPURL: "amqp://u:hunter2@h/", settleenv.PostgresURL: "postgres://u:hunter2@h/db"}
	for _, args := range [][]string{{"dlq", "list", "-h"}, {"outbox", "status", "-h"}, {"dedupe", "prune", "-h"}} {
		r := runCmd(t.Context(), vars, args...)
		if r.code != exitOK || strings.Contains(r.stdout, "hunter2") {
			t.Errorf("%v: want exit 0 without the password, got\n%v", args, r)
		}
	}
}

func TestSchemaStatements(t *testing.T) {
	t.Parallel()
	for _, d := range []sqldb.Dialect{sqldb.Postgres, sqldb.MySQL, sqldb.SQLite} {
		sdb := sql.OpenDB(noConnector{})
		t.Cleanup(func() { _ = sdb.Close() })
		db := sqldb.Std(sdb, d)
		t.Run("dedupe "+string(d), func(t *testing.T) {
			t.Parallel()
			store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Table: "app_claims"})
			if err != nil {
				t.Fatal(err)
			}
			r := mustRun(t, exitOK, "dedupe", "schema", "-dialect", string(d), "-table", "app_claims")
			checkSQL(t, r.stdout, len(store.Schema()), "app_claims")
		})
		t.Run("outbox "+string(d), func(t *testing.T) {
			t.Parallel()
			ob, err := outbox.New(db, outbox.Config{Topic: "orders_out"})
			if err != nil {
				t.Fatal(err)
			}
			r := mustRun(t, exitOK, "outbox", "schema", "-dialect", string(d), "-topic", "orders_out")
			checkSQL(t, r.stdout, len(ob.Schema()), "orders_out_relays")
			r = mustRun(t, exitOK, "outbox", "schema", "-dialect", string(d), "-topic", "orders_out", "-upgrade")
			if got, want := strings.Count(r.stdout, ";\n"), len(ob.SchemaUpgrade()); got != want {
				t.Errorf("-upgrade prints %d statements, want %d:\n%s", got, want, r.stdout)
			}
		})
	}
}

// The command's default table and topic are the library's: a store and an
// outbox configured without them print the same statements.
func TestFlagDefaultsAreTheLibrarys(t *testing.T) {
	t.Parallel()
	sdb := sql.OpenDB(noConnector{})
	defer sdb.Close()
	db := sqldb.Std(sdb, sqldb.Postgres)
	lib, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Table: defaultDedupeTable})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(lib.Schema(), cli.Schema()) {
		t.Errorf("-table defaults to %s, not the library's default:\n%q", defaultDedupeTable, lib.Schema())
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if ob.Topic() != defaultOutboxTopic {
		t.Errorf("-topic defaults to %s, the library to %s", defaultOutboxTopic, ob.Topic())
	}
}

// checkSQL checks that out holds n statements separated by blank lines, each
// ending with ';', after a comment header, and mentions name.
func checkSQL(t *testing.T, out string, n int, name string) {
	t.Helper()
	if !strings.HasPrefix(out, "-- ") {
		t.Errorf("no comment header:\n%s", out)
	}
	groups := strings.Split(strings.TrimSpace(out), "\n\n")[1:]
	if len(groups) != n {
		t.Fatalf("want %d statements, got %d:\n%s", n, len(groups), out)
	}
	for _, g := range groups {
		if !strings.HasSuffix(g, ";") || strings.Count(g, ";") != 1 {
			t.Errorf("statement does not end with exactly one ';':\n%s", g)
		}
	}
	if !strings.Contains(out, name) {
		t.Errorf("schema does not mention %s:\n%s", name, out)
	}
}

func TestTidySQL(t *testing.T) {
	t.Parallel()
	in := "\n\t\tCREATE TABLE t (\n\t\t\ta INT,\n\t\t\t\tb INT\n\t\t);\n\t"
	want := "CREATE TABLE t (\n\ta INT,\n\t\tb INT\n)"
	if got := tidySQL(in); got != want {
		t.Errorf("tidySQL:\n%q\nwant\n%q", got, want)
	}
	if got := tidySQL("SELECT 1;"); got != "SELECT 1" {
		t.Errorf("tidySQL(SELECT 1;) = %q", got)
	}
}

func TestParseInterleaved(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args  []string
		queue string
		pos   []string
	}{
		{[]string{"-queue", "q", "id1"}, "q", []string{"id1"}},
		{[]string{"id1", "-queue", "q"}, "q", []string{"id1"}},
		{[]string{"id1", "-queue", "q", "id2"}, "q", []string{"id1", "id2"}},
		{[]string{"-queue", "q", "--", "-odd-id"}, "q", []string{"-odd-id"}},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(new(bytes.Buffer))
		q := fs.String("queue", "", "")
		e := &env{stdout: new(bytes.Buffer), stderr: new(bytes.Buffer)}
		pos, err := parse(e, fs, "dlq show", tc.args)
		if err != nil || *q != tc.queue || !slices.Equal(pos, tc.pos) {
			t.Errorf("parse(%q) = %q, queue %q, %v; want %q, queue %q", tc.args, pos, *q, err, tc.pos, tc.queue)
		}
	}
}

// docs/cli.md lists every command as its usage says it.
func TestCLIDocListsEveryCommand(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.ReplaceAll(string(doc), `\|`, "|")
	for _, c := range commands {
		if !strings.Contains(text, "`settle "+synopses[c.name]+"`") {
			t.Errorf("docs/cli.md does not list `settle %s`", synopses[c.name])
		}
	}
}
