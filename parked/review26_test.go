package parked_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/settle-go/settle/parked"
)

// errOrder is a failure whose text carries an id: its group is the same
// whatever the id.
type errOrder struct {
	kind string
	id   int
}

func (e errOrder) Error() string { return fmt.Sprintf("%s: order %d failed", e.kind, e.id) }

// TestReview26Storm parks the same messages from two pools (moving them
// between failure groups), while replays, archives and prunes run on pools
// of their own: every replayed row has one copy in the outbox, and the
// group counts are the rows'.
func TestReview26Storm(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		storm(t, e, []handle{e.handle, e.another(t)}, e.another(t), e.another(t), e.another(t))
	})
}

// storm runs the storm of TestReview26Storm on the handles given.
func storm(t *testing.T, e *env, parkers []handle, rep, arc, pru handle) {
	{
		const msgs, rounds = 30, 40
		parked.SetChunk(rep.api, 4)
		var replayed atomic.Int64
		var wg sync.WaitGroup
		for w, p := range parkers {
			wg.Go(func() {
				rnd := rand.New(rand.NewPCG(uint64(w), 7))
				for i := range rounds * 3 {
					m := parkedMsg("m"+strconv.Itoa(rnd.IntN(msgs)), "charge", errOrder{[]string{"declined", "timeout"}[rnd.IntN(2)], i})
					if err := p.Park(t.Context(), m); err != nil {
						t.Errorf("park: %v", err)
						return
					}
				}
			})
		}
		wg.Go(func() {
			for range rounds {
				r, err := rep.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{By: "ops"})
				if err != nil {
					t.Errorf("replay: %v", err)
					return
				}
				replayed.Add(r.Replayed)
			}
		})
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(9, 9))
			for range rounds {
				ids := []int64{int64(rnd.IntN(msgs*3) + 1), int64(rnd.IntN(msgs*3) + 1)}
				if _, err := arc.Archive(t.Context(), parked.Filter{IDs: ids}, "ops"); err != nil {
					t.Errorf("archive: %v", err)
					return
				}
			}
		})
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(5, 5))
			for range rounds {
				ids := []int64{int64(rnd.IntN(msgs*3) + 1), int64(rnd.IntN(msgs*3) + 1)}
				if _, err := pru.Purge(t.Context(), parked.Filter{IDs: ids, State: parked.StateParked, Until: time.Now().Add(time.Hour)}); err != nil {
					t.Errorf("purge: %v", err)
					return
				}
			}
		})
		wg.Go(func() {
			for range rounds {
				if _, err := pru.Prune(t.Context(), time.Now().Add(time.Hour)); err != nil {
					t.Errorf("prune: %v", err)
					return
				}
			}
		})
		wg.Wait()
		if t.Failed() {
			return
		}
		if got := int64(len(e.outboxRows(t))); got != replayed.Load() {
			t.Errorf("%d copies in the outbox, replays reported %d", got, replayed.Load())
		}
		e.checkGroups(t)
		gs, err := e.Groups(t.Context(), parked.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		if len(gs) > 2 {
			t.Errorf("%d groups, want at most 2 (declined, timeout): %+v", len(gs), gs)
		}
	}
}

// TestReview26StormSerializable runs the storm on PostgreSQL pools whose
// sessions default to SERIALIZABLE (set in the URL, as an application
// may), through database/sql and pgx.
func TestReview26StormSerializable(t *testing.T) {
	t.Parallel()
	u := testenv.Require(t, testenv.PostgresURLEnv) + "&options=-c%20default_transaction_isolation%3Dserializable"
	stdOpen := func(t testing.TB) testenv.DB {
		db, dialect, err := sqlurl.Open(u)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return testenv.DB{DB: db, Dialect: dialect}
	}
	t.Run("std", func(t *testing.T) {
		t.Parallel()
		d := drv{name: "postgres-serializable", open: stdOpen}
		e := setup(t, d, parked.Config{})
		storm(t, e, []handle{e.handle, e.another(t)}, e.another(t), e.another(t), e.another(t))
	})
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		d := drv{name: "postgres-serializable", open: stdOpen}
		e := setup(t, d, parked.Config{})
		pool := func() handle {
			p, err := pgxpool.New(context.Background(), u)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Close)
			return bind(t, sqldb.Pgx(p), e.cfg, e.topic)
		}
		storm(t, e, []handle{pool(), pool()}, pool(), pool(), pool())
	})
}

// TestReview26ParkRacingPrune parks again messages whose rows were
// replayed (a redelivery of the original) while prunes delete those rows:
// Park must not fail (a failed Park defers the delivery and holds the
// messages behind it), and the counts stay the rows'.
func TestReview26ParkRacingPrune(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		const n = 40
		p, r, pr := e.another(t), e.another(t), e.another(t)
		var wg sync.WaitGroup
		stop := make(chan struct{})
		var failures atomic.Int64
		var first atomic.Value
		wg.Go(func() {
			for range 15 {
				for i := range n {
					if err := p.Park(t.Context(), parkedMsg("m"+strconv.Itoa(i), "charge", errBoom)); err != nil {
						failures.Add(1)
						first.CompareAndSwap(nil, err.Error())
					}
				}
			}
			close(stop)
		})
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := r.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{}); err != nil {
					t.Errorf("replay: %v", err)
					return
				}
				time.Sleep(time.Millisecond)
			}
		})
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := pr.Prune(t.Context(), time.Now().Add(time.Hour)); err != nil {
					t.Errorf("prune: %v", err)
					return
				}
				// A pause, as a real prune's interval has: on SQLite,
				// writers back to back starve a waiting Park past its
				// busy timeout (a deferral, not a loss).
				time.Sleep(time.Millisecond)
			}
		})
		wg.Wait()
		if f := failures.Load(); f > 0 {
			t.Errorf("%d of %d Parks failed racing a prune, first: %v", f, 15*n, first.Load())
		}
		e.checkGroups(t)
	})
}

// TestReview26ParkWhileRowPruned makes the window of the race above wide
// on PostgreSQL (a trigger sleeps after Park's INSERT, which does nothing
// for a row already there): a prune deletes the replayed row in that
// window, and Park must still record the message.
func TestReview26ParkWhileRowPruned(t *testing.T) {
	t.Parallel()
	for _, d := range drivers() {
		if d.name != "postgres" && !d.pgx {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, d, parked.Config{})
			e.park(t, parkedMsg("m1", "charge", errBoom))
			if r, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{}); err != nil || r.Replayed != 1 {
				t.Fatalf("replay: %+v, %v", r, err)
			}
			fn := e.table + "_slow"
			for _, s := range []string{
				`CREATE FUNCTION ` + fn + `() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$`,
				`CREATE TRIGGER ` + fn + ` AFTER INSERT ON ` + e.q(e.table) + ` FOR EACH STATEMENT EXECUTE FUNCTION ` + fn + `()`,
			} {
				if _, err := e.db.ExecContext(t.Context(), s); err != nil {
					t.Fatal(err)
				}
			}
			t.Cleanup(func() { _, _ = e.db.ExecContext(t.Context(), `DROP FUNCTION IF EXISTS `+fn+` CASCADE`) })
			pr := e.another(t)
			done := make(chan error, 1)
			go func() { done <- e.Park(t.Context(), parkedMsg("m1", "charge", errBoom)) }()
			time.Sleep(150 * time.Millisecond)
			if n, err := pr.Prune(t.Context(), time.Now().Add(time.Hour)); err != nil || n != 1 {
				t.Fatalf("prune: %d, %v", n, err)
			}
			if err := <-done; err != nil {
				t.Fatalf("Park racing a prune of its row: %v (the delivery is deferred for nothing)", err)
			}
			if n, err := e.Count(t.Context(), parked.Filter{State: parked.StateParked}); err != nil || n != 1 {
				t.Errorf("parked rows = %d, %v; want the message parked again", n, err)
			}
			e.checkGroups(t)
		})
	}
}

// TestReview26GroupsOfIDsInOtherForms: one bug is one group, whatever the
// form of the ids in its errors' text: prefixed ids (Stripe's ch_…,
// ord_17), ULIDs, KSUIDs and other base-32/62 ids. Each pair differs only
// by an id and must share a group.
func TestReview26GroupsOfIDsInOtherForms(t *testing.T) {
	t.Parallel()
	for _, c := range [][2]string{
		{"charge ord_17: card declined", "charge ord_18: card declined"},
		{"charge ch_3NkXyZ2eZvKYlo2C1abcDEFg: card declined", "charge ch_9QpLmN4rTsUvWx5Y7zAbCdEf: card declined"},
		{"order 01HGW2N7ZJ8Q5V3X9K4M6P0R1S not found", "order 01HGW2P3AB7C6D5E4F3G2H1J0K not found"},
		{"event 2ZkNxR4pQwL8mT3vY6bH1cJ9sDf not found", "event 2ZkNy7hGfT5rE4wQ1aZ8xC3vBnM not found"},
	} {
		a, _, ta := parked.GroupOf("charge", "dead_lettered", errors.New(c[0]))
		b, _, tb := parked.GroupOf("charge", "dead_lettered", errors.New(c[1]))
		if a != b {
			t.Errorf("%q and %q are two groups (%q, %q); want one", c[0], c[1], ta, tb)
		}
	}
	// Words with digits are not ids: these stay apart.
	for _, c := range [][2]string{
		{"utf8mb4_bin collation refused", "utf8mb3_bin collation refused"},
		{"decode: unknown field amount2", "decode: unknown field amount3"},
	} {
		a, _, _ := parked.GroupOf("charge", "dead_lettered", errors.New(c[0]))
		b, _, _ := parked.GroupOf("charge", "dead_lettered", errors.New(c[1]))
		if a == b {
			t.Errorf("%q and %q are one group; want two", c[0], c[1])
		}
	}
}

// TestReview26ReplayKilledAtTheServer kills the connection of a replay
// at the server (pg_terminate_backend, MariaDB's KILL) while its third
// chunk writes its copies (a trigger on the outbox makes that slow), then
// runs the replay again: every row is replayed, each with one copy.
func TestReview26ReplayKilledAtTheServer(t *testing.T) {
	t.Parallel()
	for _, d := range drivers() {
		if d.name != "postgres" && d.name != "mysql" && !d.pgx {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, d, parked.Config{})
			const n = 20
			for i := range n {
				e.park(t, parkedMsg("k"+strconv.Itoa(i), "charge", errBoom))
			}
			r := e.another(t)
			parked.SetChunk(r.api, 5)
			trg := e.topic + "_slow"
			var ddl []string
			if e.db.Dialect == sqldb.MySQL {
				ddl = []string{"CREATE TRIGGER " + trg + " AFTER INSERT ON " + e.q(e.topic) + " FOR EACH ROW SET @settle_review = SLEEP(0.3)"}
			} else {
				ddl = []string{
					`CREATE FUNCTION ` + trg + `() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$`,
					`CREATE TRIGGER ` + trg + ` AFTER INSERT ON ` + e.q(e.topic) + ` FOR EACH ROW EXECUTE FUNCTION ` + trg + `()`,
				}
				t.Cleanup(func() { _, _ = e.db.ExecContext(context.Background(), `DROP FUNCTION IF EXISTS `+trg+` CASCADE`) })
			}
			for _, s := range ddl {
				if _, err := e.db.ExecContext(t.Context(), s); err != nil {
					t.Fatal(err)
				}
			}
			done := make(chan error, 1)
			go func() {
				_, err := r.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{})
				done <- err
			}()
			// Chunks of 5 copies at 0.3 s each: once the first committed,
			// kill the connection writing copies.
			var killed int
			like := "%" + e.topic + "%"
			for deadline := time.Now().Add(60 * time.Second); killed == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				if c, err := e.Count(t.Context(), parked.Filter{State: parked.StateReplayed}); err != nil || c < 5 {
					continue
				}
				if e.db.Dialect == sqldb.MySQL {
					var id int64
					err := e.db.QueryRowContext(t.Context(), "SELECT id FROM information_schema.processlist WHERE (info LIKE ? OR info LIKE '%settle_review%') AND info NOT LIKE '%processlist%' AND id <> CONNECTION_ID() LIMIT 1", like).Scan(&id)
					if err != nil {
						continue
					}
					if _, err := e.db.ExecContext(t.Context(), "KILL "+strconv.FormatInt(id, 10)); err != nil {
						t.Fatal(err)
					}
					killed = 1
				} else if err := e.db.QueryRowContext(t.Context(), "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query ILIKE $1 AND query NOT ILIKE '%pg_stat_activity%' AND state = 'active' AND pid <> pg_backend_pid()", like).Scan(&killed); err != nil {
					t.Fatal(err)
				}
			}
			if killed != 1 {
				t.Fatalf("killed %d connections, want 1", killed)
			}
			first := <-done
			t.Logf("the killed replay returned: %v", first)
			if _, err := e.db.ExecContext(t.Context(), "DROP TRIGGER "+trg+map[bool]string{true: "", false: " ON " + e.q(e.topic)}[e.db.Dialect == sqldb.MySQL]); err != nil {
				t.Fatal(err)
			}
			res, err := r.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{})
			if err != nil {
				t.Fatalf("replay again: %v", err)
			}
			rows := e.outboxRows(t)
			seen := map[string]int{}
			for _, row := range rows {
				seen[row.Metadata["settle_replay_of"]]++
			}
			if len(seen) != n || len(rows) != n {
				t.Errorf("%d copies of %d messages after the second replay (%+v); want %d, one each", len(rows), len(seen), res, n)
			}
			if c, err := e.Count(t.Context(), parked.Filter{State: parked.StateReplayed}); err != nil || c != n {
				t.Errorf("%d rows replayed, %v; want %d", c, err, n)
			}
			e.checkGroups(t)
		})
	}
}

// TestReview26OneUncopyableRowStopsNoReplay parks three messages, the
// second consumed from a topic whose name the outbox cannot hold (over
// 255 characters on MariaDB, whose outbox topic is a VARCHAR(255)), and
// replays them all: the other two must go back, whatever becomes of the
// second (refused, skipped or reported); a replay that fails on it every
// time leaves every row behind it parked for ever.
func TestReview26OneUncopyableRowStopsNoReplay(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		for i, topic := range []string{"orders", strings.Repeat("t", 300), "orders"} {
			p := parkedMsg("u"+strconv.Itoa(i), "charge", errBoom)
			p.Topic = topic
			e.park(t, p)
		}
		res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{})
		t.Logf("replay: %+v, %v", res, err)
		got := map[string]bool{}
		for _, r := range e.outboxRows(t) {
			got[r.Metadata["settle_replay_of"]] = true
		}
		if !got["u0"] || !got["u2"] {
			t.Errorf("copies of %v; want u0 and u2 replayed whatever becomes of u1 (replay: %+v, %v)", got, res, err)
		}
		e.checkGroups(t)
	})
}

// TestReview26ReplayHostileMessages replays messages with hostile bytes
// everywhere (invalid UTF-8 and NUL in metadata keys and values, 10,000
// entries, a UUID of 100 KB, forged settle_ keys): each copy in the
// outbox carries the original's payload and metadata exactly, less the
// keys Replay sets.
func TestReview26ReplayHostileMessages(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		many := message.Metadata{}
		for i := range 10000 {
			many["k\xff"+strconv.Itoa(i)] = "v\x00" + strconv.Itoa(i)
		}
		msgs := map[string]*message.Message{
			"hostile\xff\x00": {UUID: "hostile\xff\x00", Payload: []byte{0, 0xff, 0xfe}, Metadata: message.Metadata{
				"bad\xff\xfekey": "bad\xc3value\x00nul", "": "empty", "<script>": "</script>",
				"settle_replay_of": "forged", "settle_replayed_by": "forged", "settle_replay_count": "x"}},
			"many": {UUID: "many", Payload: []byte("p"), Metadata: many},
			"long": {UUID: noise(100 << 10), Payload: []byte("p"), Metadata: message.Metadata{"a": "b"}},
		}
		for k, m := range msgs {
			delete(msgs, k)
			msgs[m.UUID] = m
		}
		for _, m := range msgs {
			e.park(t, settle.Parked{Message: m, Outcome: settle.Poisoned, Cause: errBoom, Handler: "h\xff\x00", Topic: "orders\xff", LastFailure: time.Now()})
		}
		res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{By: "ops\xff\x00"})
		if err != nil || res.Replayed != int64(len(msgs)) {
			t.Fatalf("replay: %+v, %v", res, err)
		}
		rows := e.outboxRows(t)
		if len(rows) != len(msgs) {
			t.Fatalf("%d copies, want %d", len(rows), len(msgs))
		}
		for _, r := range rows {
			of := r.Metadata["settle_replay_of"]
			m, ok := msgs[of]
			if !ok {
				t.Errorf("copy %q replays %q, no message of that UUID", brief(r.UUID), brief(of))
				continue
			}
			if !bytes.Equal(r.Payload, m.Payload) {
				t.Errorf("copy of %q: payload %q, want %q", brief(of), r.Payload, m.Payload)
			}
			for k, v := range m.Metadata {
				if strings.HasPrefix(k, "settle_") {
					continue
				}
				if r.Metadata[k] != v {
					t.Errorf("copy of %q: metadata %q = %q, want %q", brief(of), k, r.Metadata[k], v)
					break
				}
			}
			if r.Metadata["settle_replay_count"] != "1" || r.Metadata["settle_replayed_by"] == "forged" || len(r.UUID) > 200 {
				t.Errorf("copy of %q: replay keys %q %q, uuid of %d bytes", brief(of), r.Metadata["settle_replay_count"], r.Metadata["settle_replayed_by"], len(r.UUID))
			}
		}
		e.checkGroups(t)
	})
}

func brief(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// TestReview26ReasonWildcardsAndTies: a reason search takes % _ \ and !
// as plain characters, and pages of rows whose last failures are the same
// microsecond cover each row once.
func TestReview26ReasonWildcardsAndTies(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		at := time.UnixMicro(1_800_000_000_000_000)
		reasons := []string{"50% off", "50 off", "a_b", "axb", `back\slash`, `backslash`, "x!y", "x!!y", "Case", "case"}
		for i, r := range reasons {
			p := parkedMsg("r"+strconv.Itoa(i), "charge", errors.New(r))
			p.LastFailure = at
			e.park(t, p)
		}
		for _, c := range []struct {
			q    string
			want int64
		}{{"50%", 1}, {"%", 1}, {"a_b", 1}, {"_", 1}, {`\`, 1}, {`k\s`, 1}, {"x!y", 1}, {"!!", 1}, {"!", 2}, {"Case", 1}} {
			if n, err := e.Count(t.Context(), parked.Filter{Reason: c.q}); err != nil || n != c.want {
				t.Errorf("reason %q: %d rows, %v; want %d", c.q, n, err, c.want)
			}
		}
		seen := map[int64]int{}
		for _, m := range e.all(t, parked.Filter{}) {
			seen[m.ID]++
		}
		if len(seen) != len(reasons) {
			t.Errorf("pages cover %d rows, want %d", len(seen), len(reasons))
		}
		for id, n := range seen {
			if n != 1 {
				t.Errorf("row %d in %d pages", id, n)
			}
		}
	})
}

// TestReview26ReplayOfTwoHandlersRows: two handlers consume one topic
// and both fail one message (two rows, as documented). Replaying both
// writes the message twice to that topic, under one UUID: each handler
// gets it twice, and runs it twice unless its dedupe keys on the UUID.
// One copy reaches both handlers; a second is a duplicate.
//
// Fixed: each copy is a message of its own (its UUID derived from the
// handler too) addressed to its row's handler (settle.MetaReplayHandler),
// which the dedupe of every other handler acks unrun (the pipeline tests
// run the handlers).
func TestReview26ReplayOfTwoHandlersRows(t *testing.T) {
	t.Parallel()
	forEach(t, func(t *testing.T, d drv) {
		e := setup(t, d, parked.Config{})
		for _, h := range []string{"charge", "email"} {
			e.park(t, parkedMsg("m1", h, errBoom))
		}
		res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{})
		if err != nil {
			t.Fatal(err)
		}
		copies := map[string]int{}
		to := map[string]bool{}
		for _, r := range e.outboxRows(t) {
			copies[r.Topic+" "+r.UUID]++
			to[r.Metadata[settle.MetaReplayHandler]] = true
		}
		if len(to) != 2 || !to["charge"] || !to["email"] {
			t.Errorf("copies addressed to %v, want one to charge and one to email", to)
		}
		for k, n := range copies {
			if n > 1 {
				t.Errorf("copy %s written %d times to one topic (replay %+v)", k, n, res)
			}
		}
	})
}

// TestReview26StormSQLitePlainDSN runs the storm on SQLite pools opened
// as a user may open them, on a plain file name (deferred transactions,
// no busy timeout), each pool a *sql.DB of its own.
func TestReview26StormSQLitePlainDSN(t *testing.T) {
	t.Parallel()
	e := setup(t, drv{name: "sqlite", open: testenv.SQLite}, parked.Config{})
	pool := func() handle {
		db, err := sql.Open("sqlite", "file:"+e.sqlite+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return bind(t, sqldb.Std(db, sqldb.SQLite), e.cfg, e.topic)
	}
	storm(t, e, []handle{pool(), pool()}, pool(), pool(), pool())
}

// TestReview26ReplayOfTheLargestRow parks on MariaDB the largest message
// its max_allowed_packet takes (found by halving), then a small one, and
// replays both with a long ReplayOptions.By: the row was parked, so its
// copy (a little larger: the replay keys) must go, or at least not stop
// the replay of the rows behind it.
func TestReview26ReplayOfTheLargestRow(t *testing.T) {
	t.Parallel()
	if os.Getenv("SETTLE_REVIEW_HOLES") == "" {
		t.Skip("slow (a dozen parks of 16 MiB): set SETTLE_REVIEW_HOLES=1 to run it")
	}
	e := setup(t, drv{name: "mysql", open: testenv.MySQL}, parked.Config{})
	var packet int
	if err := e.db.QueryRowContext(t.Context(), "SELECT @@max_allowed_packet").Scan(&packet); err != nil {
		t.Fatal(err)
	}
	lo, hi := packet-64<<10, packet // lo parks, hi does not
	p := func(n int) error {
		m := message.NewMessage("big", bytes.Repeat([]byte{'x'}, n))
		return e.Park(t.Context(), settle.Parked{Message: m, Outcome: settle.Poisoned, Cause: errBoom, Handler: "h", Topic: "orders", LastFailure: time.Now()})
	}
	if err := p(hi); err == nil {
		t.Skip("the server takes a row of max_allowed_packet bytes")
	}
	for hi-lo > 16 {
		mid := (lo + hi) / 2
		if err := p(mid); err == nil {
			// Parked: drop it, for the next size.
			if _, err := e.db.ExecContext(t.Context(), "DELETE FROM "+e.q(e.table)); err != nil {
				t.Fatal(err)
			}
			if _, err := e.db.ExecContext(t.Context(), "DELETE FROM "+e.q(e.table+"_groups")); err != nil {
				t.Fatal(err)
			}
			lo = mid
		} else {
			hi = mid
		}
	}
	if err := p(lo); err != nil {
		t.Fatal(err)
	}
	e.park(t, parkedMsg("small", "h", errBoom))
	res, err := e.replay(t.Context(), parked.Filter{}, parked.ReplayOptions{By: strings.Repeat("o", 255)})
	got := map[string]bool{}
	for _, r := range e.outboxRows(t) {
		got[r.Metadata["settle_replay_of"]] = true
	}
	if !got["small"] {
		t.Errorf("a parked row of %d bytes of payload stops the replay of the rows after it: %+v, %v", lo, res, err)
	}
}
