package pipeline_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
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
	missing, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: "not_migrated"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: missing}); !errors.Is(err, sqldb.ErrSchema) {
		t.Fatalf("New on a missing claims table = %v; want an error wrapping sqldb.ErrSchema", err)
	}
	present, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: present}); err != nil {
		t.Fatalf("New on a migrated claims table: %v", err)
	}
}

// A transactional handler whose outbox table is missing is refused when it
// is added, with the command that creates it.
func TestHandleTxChecksTheOutboxTable(t *testing.T) {
	t.Parallel()
	db := testenv.SQLite(t)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, db)})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: store})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(sqldb.Std(db.DB, sqldb.Dialect(db.Dialect)), outbox.Config{Topic: "not_migrated"})
	if err != nil {
		t.Fatal(err)
	}
	fn := func(context.Context, *sql.Tx, *message.Message, message.Publisher) error { return nil }
	_, err = p.HandleTx("charge", "orders", ps, nil, pipeline.TxConfig{DB: db.DB, Outbox: ob}, fn)
	if err == nil || !strings.Contains(err.Error(), "outbox schema") {
		t.Fatalf("HandleTx with a missing outbox table = %v; want the command that creates it", err)
	}
	if err := ob.InitSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, err := p.HandleTx("charge", "orders", ps, nil, pipeline.TxConfig{DB: db.DB, Outbox: ob}, fn); err != nil {
		t.Fatalf("HandleTx with the outbox table made: %v", err)
	}
}

// The same on pgx: a PgxStore whose claims table is missing is refused by
// New and by HandlePgxTx.
func TestPgxStoreClaimsTableIsChecked(t *testing.T) {
	t.Parallel()
	pool := testenv.PgxPool(t)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	missing, err := dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: "not_migrated"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: missing}); !errors.Is(err, sqldb.ErrSchema) {
		t.Fatalf("New on a missing claims table = %v; want an error wrapping sqldb.ErrSchema", err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps})
	if err != nil {
		t.Fatal(err)
	}
	fn := func(context.Context, pgx.Tx, *message.Message, message.Publisher) error { return nil }
	if _, err := p.HandlePgxTx("charge", "orders", ps, missing, pipeline.PgxTxConfig{DB: pool}, fn); !errors.Is(err, sqldb.ErrSchema) {
		t.Fatalf("HandlePgxTx on a missing claims table = %v; want an error wrapping sqldb.ErrSchema", err)
	}
	present, err := dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: testenv.DedupeTable(t, testenv.Postgres(t))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.HandlePgxTx("charge", "orders", ps, present, pipeline.PgxTxConfig{DB: pool}, fn); err != nil {
		t.Fatalf("HandlePgxTx on a migrated claims table: %v", err)
	}
}
