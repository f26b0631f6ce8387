package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// refusing refuses every publish to one topic.
type refusing struct {
	message.Publisher
	topic string
}

func (p refusing) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic {
		return errors.New("refused\x1b[31m by the broker")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// outbox status shows a running relay, the rows retrying and set aside,
// and lists them; outbox retry is a dry run until -yes and re-queues what
// it is told. On PostgreSQL through pgx and database/sql, and on SQLite.
func TestOutboxStatusAndRetry(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		db     func(t *testing.T) (testenv.DB, string)
		driver []string
	}{
		{"postgres-pgx", func(t *testing.T) (testenv.DB, string) {
			return testenv.Postgres(t), testenv.Require(t, testenv.PostgresURLEnv)
		}, nil},
		{"postgres-sql", func(t *testing.T) (testenv.DB, string) {
			return testenv.Postgres(t), testenv.Require(t, testenv.PostgresURLEnv)
		}, []string{"-driver", "sql"}},
		{"sqlite", func(t *testing.T) (testenv.DB, string) {
			u := "sqlite://" + filepath.Join(t.TempDir(), "cli.db")
			db := testenv.SQLite(t) // records the service; the CLI opens its own file below
			_ = db
			d, _, err := sqlurl.Open(u)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Close() })
			return testenv.DB{DB: d, Dialect: sqldb.SQLite}, u
		}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db, u := c.db(t)
			var b [4]byte
			_, _ = rand.Read(b[:])
			topic := "cli_retry_" + hex.EncodeToString(b[:])
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
			cmd := func(args ...string) []string {
				return append(append(args[:2:2], c.driver...), append([]string{"-db", u, "-topic", topic}, args[2:]...)...)
			}
			publish := func(dest string) {
				tx, err := db.BeginTx(t.Context(), nil)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				pub, err := ob.TxPublisher(tx)
				if err != nil {
					t.Fatal(err)
				}
				if err := pub.Publish(dest, message.NewMessage(watermill.NewUUID(), []byte("{}"))); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				ob.Notify()
			}

			ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			r, err := ob.NewRelay(refusing{Publisher: ps, topic: "refused"}, outbox.RelayConfig{
				PollInterval: 10 * time.Millisecond, RetryInterval: 10 * time.Millisecond, MaxRetryInterval: 20 * time.Millisecond, MaxAttempts: 2,
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			var stopOnce sync.Once
			stopRelay := func() {
				stopOnce.Do(func() {
					cancel()
					if err := <-done; err != nil {
						t.Error(err)
					}
					_ = r.Close()
				})
			}
			t.Cleanup(stopRelay)
			<-r.Running()

			// Nothing pending, a relay running: it is counted.
			res := mustRun(t, exitOK, cmd("outbox", "status")...)
			if !strings.Contains(res.stdout, "relays:  1 alive\n") || !strings.Contains(res.stdout, "set aside: 0\n") {
				t.Fatalf("status of an idle outbox with a relay:\n%v", res)
			}

			publish("refused")
			publish("refused")
			deadline := time.Now().Add(30 * time.Second)
			for {
				publish("fine") // the broker takes these
				st, err := ob.Status(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				if st.SetAside == 2 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("rows not set aside: %+v", st)
				}
				time.Sleep(20 * time.Millisecond)
			}

			res = mustRun(t, exitFail, cmd("outbox", "status")...)
			if !strings.Contains(res.stdout, "state:   set_aside\n") || !strings.Contains(res.stdout, "set aside: 2\n") ||
				!strings.Contains(res.stdout, "relays:  1 alive\n") || strings.Count(res.stdout, "set aside 20") != 2 {
				t.Fatalf("status with two rows set aside:\n%v", res)
			}
			if strings.Contains(res.stdout, "\x1b") || !strings.Contains(res.stdout, `refused\x1b[31m by the broker`) {
				t.Fatalf("the row's error reaches the terminal unescaped:\n%q", res.stdout)
			}
			res = mustRun(t, exitFail, cmd("outbox", "status", "-json")...)
			var st struct {
				State    string `json:"state"`
				SetAside int64  `json:"set_aside"`
				Failed   []struct {
					Offset    int64  `json:"offset"`
					Topic     string `json:"topic"`
					SetAside  bool   `json:"set_aside"`
					Attempts  int    `json:"attempts"`
					LastError string `json:"last_error"`
				} `json:"failed"`
			}
			if err := json.Unmarshal([]byte(res.stdout), &st); err != nil {
				t.Fatalf("status -json: %v\n%v", err, res)
			}
			if st.State != "set_aside" || st.SetAside != 2 || len(st.Failed) != 2 || !st.Failed[0].SetAside || st.Failed[0].Topic != "refused" || st.Failed[0].Attempts < 2 {
				t.Fatalf("status -json = %+v", st)
			}

			// The relay stops before the retries: a row re-queued to the
			// refusing topic is retried at once (its relay notified, on
			// PostgreSQL) and set aside again after MaxAttempts, which on
			// a loaded machine happened before the check below read the
			// set-aside rows.
			stopRelay()
			res = mustRun(t, exitUsage, cmd("outbox", "retry")...)
			if !strings.Contains(res.stderr, "-offset N, -dest TOPIC, or -all") {
				t.Fatalf("retry without a selection:\n%v", res)
			}
			// A dry run changes nothing.
			res = mustRun(t, exitOK, cmd("outbox", "retry", "-all")...)
			if !strings.Contains(res.stdout, "dry run: 2 set-aside row(s)") {
				t.Fatalf("retry -all:\n%v", res)
			}
			if s, _ := ob.Status(t.Context()); s.SetAside != 2 {
				t.Fatalf("a dry run re-queued rows: %+v", s)
			}
			res = mustRun(t, exitOK, cmd("outbox", "retry", "-dest", "elsewhere", "-yes")...)
			if !strings.Contains(res.stdout, "no set-aside row") {
				t.Fatalf("retry -dest elsewhere:\n%v", res)
			}
			off := strconv.FormatInt(st.Failed[1].Offset, 10)
			res = mustRun(t, exitOK, cmd("outbox", "retry", "-offset", off, "-yes")...)
			if !strings.Contains(res.stdout, "re-queued 1 row(s)") {
				t.Fatalf("retry -offset %s -yes:\n%v", off, res)
			}
			rows, err := ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil || len(rows) != 1 || rows[0].Offset != st.Failed[0].Offset {
				t.Fatalf("after re-queueing one: %+v, %v", rows, err)
			}
		})
	}
}
