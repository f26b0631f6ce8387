package pipeline_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// A pipeline on a SQL store whose claims table is missing is refused when it
// is built, with the DDL to run, instead of deferring every delivery.
func TestNewChecksTheClaimsTable(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	missing, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: db.Dialect, Table: "not_migrated"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: missing}); !errors.Is(err, dedupe.ErrSchema) {
		t.Fatalf("New on a missing claims table = %v; want an error wrapping dedupe.ErrSchema", err)
	}
	present, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: db.Dialect, Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: present}); err != nil {
		t.Fatalf("New on a migrated claims table: %v", err)
	}
}
