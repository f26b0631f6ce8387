package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// parkedEnv is a parked-message table and an outbox of a test, on one
// database, and the command line's flags that reach them.
type parkedEnv struct {
	t       *testing.T
	url     string
	driver  []string // -driver flag, if any
	db      *sql.DB
	dialect string
	table   string // the parked table
	outbox  string // the outbox topic (and table)
	store   *parked.Store[*sql.Tx]
}

// setupParked creates a parked table and an outbox on the database at u,
// dropped when the test ends.
func setupParked(t *testing.T, u string, driver []string) *parkedEnv {
	t.Helper()
	db, dialect := openTestDB(t, u)
	p := &parkedEnv{t: t, url: u, driver: driver, db: db, dialect: dialect,
		table: shortName("cli_pk_"), outbox: shortName("cli_pko_")}
	s, err := parked.New(sqldb.Std(db, sqldb.Dialect(dialect)), parked.Config{Table: p.table})
	if err != nil {
		t.Fatal(err)
	}
	p.store = s
	t.Cleanup(func() {
		for _, tbl := range []string{p.table, p.table + "_groups", p.outbox, p.outbox + "_relays"} {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+p.quote(tbl))
		}
	})
	// The tables from the command's own schema, checked by the store.
	createFromSchema(t, db, "parked", "schema", "-dialect", dialect, "-table", p.table)
	if err := s.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	createFromSchema(t, db, "outbox", "schema", "-dialect", dialect, "-topic", p.outbox)
	return p
}

func (p *parkedEnv) quote(name string) string {
	if p.dialect == "mysql" {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}

// args is a command line of the store: the command's words, then the
// flags that reach the store, then rest.
func (p *parkedEnv) args(words string, rest ...string) []string {
	a := append(strings.Fields(words), "-db", p.url, "-table", p.table)
	a = append(a, p.driver...)
	if strings.HasPrefix(words, "parked replay") {
		a = append(a, "-outbox", p.outbox)
	}
	return append(a, rest...)
}

// run runs a command of the store and fails the test unless it exits with
// want.
func (p *parkedEnv) run(want int, words string, rest ...string) result {
	p.t.Helper()
	return mustRun(p.t, want, p.args(words, rest...)...)
}

// park parks a message in the table.
func (p *parkedEnv) park(uuid, handler, topic string, outcome settle.Outcome, cause string, lastFailure time.Time, payload string, md map[string]string) {
	p.t.Helper()
	msg := message.NewMessage(uuid, []byte(payload))
	for k, v := range md {
		msg.Metadata.Set(k, v)
	}
	err := p.store.Park(p.t.Context(), settle.Parked{Message: msg, Outcome: outcome, Cause: errors.New(cause),
		Handler: handler, Topic: topic, Key: "key-" + uuid, Attempts: 3, FirstFailure: lastFailure.Add(-time.Minute), LastFailure: lastFailure})
	if err != nil {
		p.t.Fatal(err)
	}
}

// outboxRows returns the outbox's rows: UUID -> how many rows, and UUID ->
// destination topic.
func (p *parkedEnv) outboxRows() (count map[string]int, topic map[string]string) {
	p.t.Helper()
	rows, err := p.db.QueryContext(p.t.Context(), "SELECT uuid, topic FROM "+p.quote(p.outbox))
	if err != nil {
		p.t.Fatal(err)
	}
	defer rows.Close()
	count, topic = map[string]int{}, map[string]string{}
	for rows.Next() {
		var u, to string
		if err := rows.Scan(&u, &to); err != nil {
			p.t.Fatal(err)
		}
		count[u]++
		topic[u] = to
	}
	if err := rows.Err(); err != nil {
		p.t.Fatal(err)
	}
	return count, topic
}

// states returns the state of each row by UUID.
func (p *parkedEnv) states() map[string]parked.State {
	p.t.Helper()
	out := map[string]parked.State{}
	q := parked.Query{Limit: 1000}
	for {
		page, err := p.store.List(p.t.Context(), q)
		if err != nil {
			p.t.Fatal(err)
		}
		for _, m := range page.Messages {
			out[m.UUID] = m.State
		}
		if page.Next == "" {
			return out
		}
		q.Cursor = page.Next
	}
}

// idOf returns the row id of the message uuid.
func (p *parkedEnv) idOf(uuid string) int64 {
	p.t.Helper()
	page, err := p.store.List(p.t.Context(), parked.Query{Filter: parked.Filter{UUID: uuid}})
	if err != nil || len(page.Messages) != 1 {
		p.t.Fatalf("row of %q: %v, %v", uuid, page.Messages, err)
	}
	return page.Messages[0].ID
}

var (
	listID   = regexp.MustCompile(`(?m)^(\d+)\s`)
	nextPage = regexp.MustCompile(`(?m)^next page: settle (.*)$`)
	groupRow = regexp.MustCompile(`(?m)^(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s`)
)

// listIDs returns the row ids a list printed.
func listIDs(out string) []string {
	var ids []string
	for _, m := range listID.FindAllStringSubmatch(out, -1) {
		ids = append(ids, m[1])
	}
	return ids
}

// The hostile row: control sequences, C1 controls, text reordering and
// bytes that are not UTF-8 in every field the commands print.
const (
	hostileUUID    = "u-\x1b[2J-\u009b2J"
	hostileHandler = "evil\x1b]0;pwned\x07"
	hostileTopic   = "t\u202eopic"
	hostileReason  = "<script>alert(1)</script>\x1b[2J\u009b31m \xff\xfe boom"
	hostilePayload = "\xff\xfe\x1b[2J\u009b2J<script>"
)

// assertSafe fails when out holds something a terminal acts on: a raw
// control character (other than newline and tab), a C1 control, a
// character that reorders text, or bytes that are not UTF-8.
func assertSafe(t *testing.T, what, out string) {
	t.Helper()
	if !utf8.ValidString(out) {
		t.Errorf("%s prints bytes that are not UTF-8:\n%q", what, out)
	}
	for _, r := range out {
		if r < 0x20 && r != '\n' && r != '\t' || r >= 0x7f && r <= 0x9f || bidiControl(r) {
			t.Errorf("%s prints %U raw:\n%q", what, r, out)
			return
		}
	}
}

// Every parked command on every database and driver: list with filters and
// keyset pages (following the next-page command it prints), groups, show
// (JSON pretty-printed, a hostile row escaped), replay (dry run changes
// nothing; -yes writes one outbox row per message and marks the rows; run
// again writes none; the loop guard refuses, -force and -to), archive and
// purge (dry runs, -before required, parked rows kept unless named).
func TestParkedCommands(t *testing.T) {
	t.Parallel()
	for _, tc := range pruneDatabases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := setupParked(t, tc.url(t), tc.driver)
			now := time.Now()
			orders, emails := shortName("orders_"), shortName("emails_")
			var charges []string
			for i := range 5 {
				u := fmt.Sprintf("charge-%d-%s", i, shortName(""))
				charges = append(charges, u)
				last := now.Add(-time.Minute)
				if i < 2 {
					last = now.Add(-48 * time.Hour)
				}
				p.park(u, "charge", orders, settle.DeadLettered, fmt.Sprintf("card declined for order %d", 17+i), last,
					fmt.Sprintf(`{"order":%d,"items":[1,2]}`, 17+i), map[string]string{"tenant": "acme"})
			}
			guarded := "charge-guard-" + shortName("")
			p.park(guarded, "charge", orders, settle.DeadLettered, "card declined for order 99", now.Add(-time.Minute), `{}`,
				map[string]string{settle.MetaReplayCount: "3"})
			mails := []string{"mail-1-" + shortName(""), "mail-2-" + shortName("")}
			for _, u := range mails {
				p.park(u, "email", emails, settle.Poisoned, "smtp: 550 no such user", now.Add(-time.Minute), "hello", nil)
			}
			p.park(hostileUUID, hostileHandler, hostileTopic, settle.DeadLettered, hostileReason, now.Add(-time.Minute), hostilePayload,
				map[string]string{"k\x1b[2J": "v\u202e\x1b]0;title\x07"})
			all := 9

			// list: everything, a filter, pages.
			r := p.run(exitOK, "parked list")
			assertSafe(t, "parked list", r.stdout)
			if ids := listIDs(r.stdout); len(ids) != all {
				t.Fatalf("list shows %d rows, want %d:\n%v", len(ids), all, r)
			}
			if !strings.Contains(r.stdout, `\x1b[2J`) || !strings.Contains(r.stdout, `\u009b`) || !strings.Contains(r.stdout, `\u202e`) {
				t.Errorf("list does not show the hostile row's fields escaped:\n%s", r.stdout)
			}
			r = p.run(exitOK, "parked list", "-handler", "email", "-outcome", "poisoned")
			if ids := listIDs(r.stdout); len(ids) != 2 || !strings.Contains(r.stdout, mails[0]) || !strings.Contains(r.stdout, mails[1]) {
				t.Fatalf("list -handler email:\n%v", r)
			}
			r = p.run(exitOK, "parked list", "-since", "24h", "-handler", "charge")
			if ids := listIDs(r.stdout); len(ids) != 4 || strings.Contains(r.stdout, charges[0]) {
				t.Fatalf("list -since 24h -handler charge: want the 4 recent charges:\n%v", r)
			}
			r = p.run(exitOK, "parked list", "-until", now.Add(-24*time.Hour).UTC().Format(time.RFC3339))
			if ids := listIDs(r.stdout); len(ids) != 2 {
				t.Fatalf("list -until a day ago: want the 2 old charges:\n%v", r)
			}
			seen := map[string]bool{}
			args := p.args("parked list", "-limit", "4")
			for pages := 0; ; pages++ {
				if pages > all {
					t.Fatal("the pages do not end")
				}
				r = mustRun(t, exitOK, args...)
				for _, id := range listIDs(r.stdout) {
					if seen[id] {
						t.Fatalf("row %s on two pages", id)
					}
					seen[id] = true
				}
				m := nextPage.FindStringSubmatch(r.stdout)
				if m == nil {
					break
				}
				args = strings.Fields(strings.ReplaceAll(m[1], "'", ""))
				if !slices.Contains(args, "-after") || !slices.Contains(args, "4") {
					t.Fatalf("next page command %q", m[1])
				}
			}
			if len(seen) != all {
				t.Fatalf("the pages showed %d rows, want %d", len(seen), all)
			}
			r = p.run(exitUsage, "parked list", "-state", "gone")
			r = p.run(exitUsage, "parked list", "-since", "yesterday")

			// groups
			r = p.run(exitOK, "parked groups")
			assertSafe(t, "parked groups", r.stdout)
			var chargeGroup string
			for _, m := range groupRow.FindAllStringSubmatch(r.stdout, -1) {
				switch m[2] {
				case "charge":
					chargeGroup = m[1]
					if m[3] != "dead_lettered" || m[4] != "6" || m[5] != "6" {
						t.Errorf("charge group: %q", m[0])
					}
				case "email":
					if m[4] != "2" {
						t.Errorf("email group: %q", m[0])
					}
				}
			}
			if chargeGroup == "" || strings.Count(r.stdout, "\n") != 5 {
				t.Fatalf("groups: want a header, three groups and a hint:\n%v", r)
			}

			// show
			r = p.run(exitOK, "parked show", strconv.FormatInt(p.idOf(charges[2]), 10))
			for _, want := range []string{"handler:", "charge", `"order": 19,`, "payload (26 bytes, JSON):", "tenant: acme", "card declined for order 19", "key-" + charges[2], chargeGroup} {
				if !strings.Contains(r.stdout, want) {
					t.Errorf("show does not say %q:\n%s", want, r.stdout)
				}
			}
			r = p.run(exitOK, "parked show", strconv.FormatInt(p.idOf(hostileUUID), 10))
			assertSafe(t, "parked show of the hostile row", r.stdout)
			for _, want := range []string{`u-\x1b[2J-\u009b2J`, `evil\x1b]0;pwned\x07`, `t\u202eopic`, `<script>alert(1)</script>\x1b[2J\u009b31m`, `k\x1b[2J: v\u202e\x1b]0;title\x07`, "not UTF-8, hex", "ff fe 1b 5b 32 4a"} {
				if !strings.Contains(r.stdout, want) {
					t.Errorf("show of the hostile row does not say %q:\n%s", want, r.stdout)
				}
			}
			// -json: the data whole, escaped only as JSON.
			r = p.run(exitOK, "parked show", strconv.FormatInt(p.idOf(hostileUUID), 10), "-json")
			assertSafe(t, "parked show -json", r.stdout)
			var shown parkedJSON
			if err := json.Unmarshal([]byte(r.stdout), &shown); err != nil {
				t.Fatalf("show -json: %v\n%s", err, r.stdout)
			}
			if string(shown.PayloadBase64) != hostilePayload || shown.Payload != nil || shown.UUID != hostileUUID ||
				shown.Metadata["k\x1b[2J"] != "v\u202e\x1b]0;title\x07" || !strings.HasPrefix(shown.Reason, "<script>alert(1)</script>\x1b[2J\u009b31m") {
				t.Errorf("show -json of the hostile row: %+v", shown)
			}
			r = p.run(exitOK, "parked list", "-json", "-limit", "5")
			var listed struct {
				Messages []parkedJSON `json:"messages"`
				Next     string       `json:"next"`
			}
			if err := json.Unmarshal([]byte(r.stdout), &listed); err != nil || len(listed.Messages) != 5 || listed.Next == "" || listed.Messages[0].Payload != nil {
				t.Fatalf("list -json: %v %+v\n%s", err, listed, r.stdout)
			}
			r = p.run(exitOK, "parked groups", "-json")
			var groups []groupJSON
			if err := json.Unmarshal([]byte(r.stdout), &groups); err != nil || len(groups) != 3 {
				t.Fatalf("groups -json: %v\n%s", err, r.stdout)
			}
			for _, g := range groups {
				if g.ID == chargeGroup && (g.Parked != 6 || g.Handler != "charge" || g.LastSeen == "") {
					t.Errorf("groups -json, the charge group: %+v", g)
				}
			}
			p.run(exitFail, "parked show", "999999999")
			p.run(exitUsage, "parked show", "x")

			// replay: a dry run changes nothing.
			before := p.states()
			r = p.run(exitOK, "parked replay", "-group", chargeGroup)
			for _, want := range []string{"would replay 5 parked messages through outbox " + p.outbox + ", to:", "  " + orders + "  5", "refused by the loop guard: 1", "dry run: nothing replayed"} {
				if !strings.Contains(r.stdout, want) {
					t.Errorf("replay dry run does not say %q:\n%s", want, r.stdout)
				}
			}
			if n, _ := p.outboxRows(); len(n) != 0 {
				t.Fatalf("the dry run wrote %d outbox rows", len(n))
			}
			if after := p.states(); !maps.Equal(before, after) {
				t.Fatalf("the dry run changed rows: %v -> %v", before, after)
			}
			p.run(exitUsage, "parked replay")
			p.run(exitUsage, "parked replay", "-all", "-group", chargeGroup)

			// replay -yes: one outbox row per message, rows marked.
			r = p.run(exitOK, "parked replay", "-group", chargeGroup, "-yes", "-by", "ops@test")
			if !strings.Contains(r.stdout, "replayed 5 messages into outbox "+p.outbox+" as ops@test") {
				t.Errorf("replay -yes:\n%v", r)
			}
			count, topic := p.outboxRows()
			if len(count) != 5 {
				t.Fatalf("outbox rows after the replay: %v", count)
			}
			for _, u := range charges {
				id := replay.UUID(u, "charge", 1)
				if count[id] != 1 || topic[id] != orders {
					t.Errorf("%s: %d outbox rows to %q; want 1 to %s", u, count[id], topic[id], orders)
				}
			}
			st := p.states()
			for _, u := range charges {
				if st[u] != parked.StateReplayed {
					t.Errorf("%s is %s after the replay", u, st[u])
				}
			}
			if st[guarded] != parked.StateParked {
				t.Errorf("the row the loop guard refused is %s", st[guarded])
			}
			// Again: nothing left to replay.
			r = p.run(exitOK, "parked replay", "-group", chargeGroup, "-yes")
			if !strings.Contains(r.stdout, "replaying 0 parked messages") || !strings.Contains(r.stdout, "skipped: 5") {
				t.Errorf("second replay:\n%v", r)
			}
			if count, _ := p.outboxRows(); len(count) != 5 {
				t.Fatalf("the second replay wrote rows: %v", count)
			}
			// The application's loop guard, when it is not the default.
			r = p.run(exitOK, "parked replay", "-uuid", guarded, "-max-replays", "4")
			if !strings.Contains(r.stdout, "would replay 1 parked messages") || strings.Contains(r.stdout, "refused") {
				t.Errorf("replay -max-replays 4 of a message replayed 3 times:\n%v", r)
			}
			// -force and -to.
			other := shortName("other_")
			r = p.run(exitOK, "parked replay", "-uuid", guarded, "-to", other, "-force", "-yes")
			count, topic = p.outboxRows()
			if id := replay.UUID(guarded, "charge", 4); count[id] != 1 || topic[id] != other || len(count) != 6 {
				t.Fatalf("replay -force -to %s: outbox %v %v\n%v", other, count, topic, r)
			}

			// archive
			r = p.run(exitOK, "parked archive", "-handler", "email")
			if !strings.Contains(r.stdout, "would archive 2 parked messages") || p.states()[mails[0]] != parked.StateParked {
				t.Fatalf("archive dry run:\n%v", r)
			}
			r = p.run(exitOK, "parked archive", "-handler", "email", "-yes")
			if st := p.states(); !strings.Contains(r.stdout, "archived 2 parked messages") || st[mails[0]] != parked.StateArchived || st[mails[1]] != parked.StateArchived {
				t.Fatalf("archive -yes:\n%v", r)
			}

			// purge: -before required; parked rows kept unless named.
			p.run(exitUsage, "parked purge")
			r = p.run(exitOK, "parked purge", "-before", "24h")
			if !strings.Contains(r.stdout, "would delete 2 replayed or archived rows") || len(p.states()) != all {
				t.Fatalf("purge dry run:\n%v", r)
			}
			r = p.run(exitOK, "parked purge", "-before", "24h", "-yes")
			st = p.states()
			if !strings.Contains(r.stdout, "deleted 2 rows") || len(st) != all-2 || st[charges[0]] != "" || st[charges[1]] != "" {
				t.Fatalf("purge -yes: %v\n%v", st, r)
			}
			r = p.run(exitOK, "parked purge", "-before", "1s", "-state", "parked", "-handler", hostileHandler, "-yes")
			if st := p.states(); !strings.Contains(r.stdout, "deleted 1 rows") || st[hostileUUID] != "" || len(st) != all-3 {
				t.Fatalf("purge -state parked: %v\n%v", st, r)
			}
		})
	}
}

// The next-page command of a list repeats the flags given, but never a
// password of -db: PostgreSQL here trusts the connection, so the command
// runs with a password in its URL and prints the command with it redacted.
func TestParkedNextPageHidesThePassword(t *testing.T) {
	t.Parallel()
	u := testenv.Require(t, testenv.PostgresURLEnv)
	p := setupParked(t, u, nil)
	for i := range 3 {
		p.park(fmt.Sprintf("pw-%d", i), "charge", "orders", settle.DeadLettered, "declined", time.Now(), "{}", nil)
	}
	withPW := strings.Replace(u, "postgres@", "postgres:PWsecret@", 1)
	if withPW == u {
		t.Fatalf("cannot put a password into %s", redact(u))
	}
	r := mustRun(t, exitOK, "parked", "list", "-db", withPW, "-table", p.table, "-limit", "1", "-reason", "it's declined")
	if strings.Contains(r.stdout+r.stderr, "PW") {
		t.Fatalf("the password is printed:\n%v", r)
	}
	r = mustRun(t, exitOK, "parked", "list", "-db", withPW, "-table", p.table, "-limit", "1")
	m := nextPage.FindStringSubmatch(r.stdout)
	if m == nil || strings.Contains(r.stdout+r.stderr, "PW") || !strings.Contains(m[1], "postgres:xxxxx@") {
		t.Fatalf("want a next-page command with the password redacted:\n%v", r)
	}
}

// A long replay says how far it is, at most once a second.
func TestReplayProgressLines(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { return now }
	p := replayProgress(&out, 1000, clock)
	for _, step := range []struct {
		replayed int64
		after    time.Duration
	}{{200, 0}, {400, 300 * time.Millisecond}, {600, 800 * time.Millisecond}, {800, 300 * time.Millisecond}, {1000, 2 * time.Second}} {
		now = now.Add(step.after)
		p(parked.ReplayResult{Replayed: step.replayed})
	}
	if want := "replayed 200 of 1000\nreplayed 600 of 1000\nreplayed 1000 of 1000\n"; out.String() != want {
		t.Errorf("progress lines:\n%s\nwant:\n%s", out.String(), want)
	}
}
