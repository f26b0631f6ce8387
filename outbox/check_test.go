package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// Check passes on tables made by InitSchema, and on a missing or
// mis-shaped table names it and says which command prints the DDL.
func TestCheck(t *testing.T) {
	t.Parallel()
	for _, d := range drivers() {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			db := d.open(t)
			name := testenv.Name(t, "chk")
			topic := "chk_" + name[len(name)-8:]
			ob, err := outboxOn(t, d, db)(outbox.Config{Topic: topic})
			if err != nil {
				t.Fatal(err)
			}
			q := func(s string) string {
				if db.Dialect == sqldb.MySQL {
					return "`" + s + "`"
				}
				return `"` + s + `"`
			}
			t.Cleanup(func() {
				for _, tb := range []string{topic, topic + "_relays"} {
					_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q(tb))
				}
			})
			hint := "settle outbox schema -dialect " + string(db.Dialect) + " -topic " + topic

			err = ob.Check(t.Context())
			if !errors.Is(err, sqldb.ErrSchema) || !strings.Contains(err.Error(), "table "+topic+" does not exist") ||
				!strings.Contains(err.Error(), "table "+topic+"_relays does not exist") || !strings.Contains(err.Error(), hint) {
				t.Fatalf("Check before InitSchema = %v; want ErrSchema naming both tables and %q", err, hint)
			}
			var se *sqldb.SchemaError
			if !errors.As(err, &se) || se.Table != topic || !slices.Equal(se.DDL, ob.Schema()) {
				t.Fatalf("Check before InitSchema = %#v; want a *sqldb.SchemaError naming %s with the statements of Schema", err, topic)
			}
			// Status and Prune on the missing tables give the same hint.
			if _, err := ob.Status(t.Context()); !errors.Is(err, sqldb.ErrSchema) {
				t.Errorf("Status on missing tables = %v; want ErrSchema", err)
			}
			if _, err := ob.Prune(t.Context(), time.Now()); !errors.Is(err, sqldb.ErrSchema) {
				t.Errorf("Prune on missing tables = %v; want ErrSchema", err)
			}

			if err := ob.InitSchema(t.Context()); err != nil {
				t.Fatal(err)
			}
			if err := ob.InitSchema(t.Context()); err != nil {
				t.Fatalf("InitSchema twice: %v", err)
			}
			if err := ob.Check(t.Context()); err != nil {
				t.Fatalf("Check after InitSchema = %v", err)
			}

			// A table of the old shape (watermill-sql's, no topic or
			// forwarded_at column) under the outbox's name.
			if _, err := db.ExecContext(t.Context(), "DROP TABLE "+q(topic)); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+q(topic)+" ("+q("offset")+" BIGINT PRIMARY KEY, uuid VARCHAR(36), payload TEXT, metadata TEXT, created_at TIMESTAMP)"); err != nil {
				t.Fatal(err)
			}
			err = ob.Check(t.Context())
			if !errors.Is(err, sqldb.ErrSchema) || !strings.Contains(err.Error(), "lacks column(s) topic, forwarded_at") || !strings.Contains(err.Error(), hint) {
				t.Fatalf("Check of a mis-shaped table = %v; want the missing columns and %q", err, hint)
			}
		})
	}
}

// oldOutboxDDL is the outbox table of settle before per-row failures, as
// its Schema returned it.
func oldOutboxDDL(d sqldb.Dialect, topic string) []string {
	switch d {
	case sqldb.Postgres:
		return []string{`CREATE TABLE "` + topic + `" (
	"offset" BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "uuid" TEXT NOT NULL, "topic" TEXT NOT NULL, "payload" BYTEA NOT NULL,
	"metadata" TEXT NOT NULL, "created_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), "forwarded_at" TIMESTAMPTZ)`,
			`CREATE INDEX "` + topic + `_pending" ON "` + topic + `" ("offset") WHERE "forwarded_at" IS NULL`}
	case sqldb.MySQL:
		return []string{"CREATE TABLE `" + topic + "` (`offset` BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, uuid TEXT NOT NULL, topic VARCHAR(255) NOT NULL, " +
			"payload LONGBLOB NOT NULL, metadata LONGTEXT NOT NULL, created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), " +
			"forwarded_at TIMESTAMP(6) NULL DEFAULT NULL, KEY `" + topic + "_pending` (forwarded_at, `offset`))"}
	default:
		return []string{`CREATE TABLE "` + topic + `" ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, "uuid" TEXT NOT NULL, "topic" TEXT NOT NULL,
	"payload" BLOB NOT NULL, "metadata" TEXT NOT NULL, "created_at" TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')), "forwarded_at" TEXT)`,
			`CREATE INDEX "` + topic + `_pending" ON "` + topic + `" ("offset") WHERE "forwarded_at" IS NULL`}
	}
}

// An outbox table of the earlier shape: Check names the missing columns
// and the upgrade command; SchemaUpgrade's statements bring it to the new
// shape, keeping its pending rows, which a relay then forwards.
func TestSchemaUpgradeFromTheTableWithoutFailures(t *testing.T) {
	t.Parallel()
	for _, d := range brokerCases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			db := d.open(t)
			name := testenv.Name(t, "upg")
			topic := "upg_" + name[len(name)-8:]
			ob, err := outboxOn(t, d, db)(outbox.Config{Topic: topic})
			if err != nil {
				t.Fatal(err)
			}
			q := func(s string) string {
				if db.Dialect == sqldb.MySQL {
					return "`" + s + "`"
				}
				return `"` + s + `"`
			}
			t.Cleanup(func() {
				for _, tb := range []string{topic, topic + "_relays"} {
					_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q(tb))
				}
			})
			stmts := ob.Schema()
			for _, s := range append(oldOutboxDDL(db.Dialect, topic), stmts[len(stmts)-1]) { // the relays' table is unchanged
				if _, err := db.ExecContext(t.Context(), s); err != nil {
					t.Fatalf("%s: %v", s, err)
				}
			}
			ph := "?, ?, ?, ?"
			if db.Dialect == sqldb.Postgres {
				ph = "$1, $2, $3, $4"
			}
			if _, err := db.ExecContext(t.Context(), "INSERT INTO "+q(topic)+" (uuid, topic, payload, metadata) VALUES ("+ph+")", "old-row", "orders", []byte("{}"), "{}"); err != nil {
				t.Fatal(err)
			}

			err = ob.Check(t.Context())
			want := "table " + topic + " lacks column(s) attempts, last_error, next_attempt_at, set_aside_at"
			if !errors.Is(err, sqldb.ErrSchema) || !strings.Contains(err.Error(), want) ||
				!strings.Contains(err.Error(), "settle outbox schema -upgrade -dialect "+string(db.Dialect)+" -topic "+topic) {
				t.Fatalf("Check of the earlier table = %v; want %q and the upgrade command", err, want)
			}
			var se *sqldb.SchemaError
			if !errors.As(err, &se) || se.Table != topic || !slices.Equal(se.DDL, ob.SchemaUpgrade()) {
				t.Fatalf("Check of the earlier table = %#v; want a *sqldb.SchemaError naming %s with the upgrade statements", err, topic)
			}
			for _, s := range ob.SchemaUpgrade() {
				if _, err := db.ExecContext(t.Context(), s); err != nil {
					t.Fatalf("%s: %v", s, err)
				}
			}
			if err := ob.Check(t.Context()); err != nil {
				t.Fatalf("Check after the upgrade = %v", err)
			}
			ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			got, err := ps.Subscribe(t.Context(), "orders")
			if err != nil {
				t.Fatal(err)
			}
			if n, err := ob.Forward(t.Context(), ps, outbox.RelayConfig{PollInterval: 10 * time.Millisecond}); err != nil || n != 1 {
				t.Fatalf("Forward after the upgrade = %d, %v; want the old row", n, err)
			}
			if m := <-got; m.UUID != "old-row" {
				t.Fatalf("forwarded %s", m.UUID)
			}
		})
	}
}
