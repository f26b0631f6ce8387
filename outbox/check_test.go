package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// Check passes on tables made by InitSchema, and on a missing or
// mis-shaped table names it and says which command prints the DDL.
func TestCheck(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			name := testenv.Name(t, "chk")
			topic := "chk_" + name[len(name)-8:]
			ob, err := outbox.New(outbox.Config{Dialect: db.Dialect, Topic: topic})
			if err != nil {
				t.Fatal(err)
			}
			q := func(s string) string {
				if db.Dialect == dedupe.MySQL {
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

			err = ob.Check(t.Context(), db.DB)
			if !errors.Is(err, outbox.ErrSchema) || !strings.Contains(err.Error(), "table "+topic+" does not exist") ||
				!strings.Contains(err.Error(), "table "+topic+"_relays does not exist") || !strings.Contains(err.Error(), hint) {
				t.Fatalf("Check before InitSchema = %v; want ErrSchema naming both tables and %q", err, hint)
			}
			// Status and Prune on the missing tables give the same hint.
			if _, err := ob.Status(t.Context(), db.DB); !errors.Is(err, outbox.ErrSchema) {
				t.Errorf("Status on missing tables = %v; want ErrSchema", err)
			}
			if _, err := ob.Prune(t.Context(), db.DB, 0); !errors.Is(err, outbox.ErrSchema) {
				t.Errorf("Prune on missing tables = %v; want ErrSchema", err)
			}

			if err := ob.InitSchema(t.Context(), db.DB); err != nil {
				t.Fatal(err)
			}
			if err := ob.InitSchema(t.Context(), db.DB); err != nil {
				t.Fatalf("InitSchema twice: %v", err)
			}
			if err := ob.Check(t.Context(), db.DB); err != nil {
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
			err = ob.Check(t.Context(), db.DB)
			if !errors.Is(err, outbox.ErrSchema) || !strings.Contains(err.Error(), "lacks column(s) topic, forwarded_at") || !strings.Contains(err.Error(), hint) {
				t.Fatalf("Check of a mis-shaped table = %v; want the missing columns and %q", err, hint)
			}
		})
	}
}
