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
// is built (New), and so is a transactional handler given one (HandleTx),
// with the DDL to run, instead of deferring every delivery.
func TestNewChecksTheClaimsTable(t *testing.T) {
	t.Parallel()
	onEachDriver(t, checksTheClaimsTable[*sql.Tx], checksTheClaimsTable[pgx.Tx])
}

func checksTheClaimsTable[TTx any](t *testing.T, d db[TTx]) {
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	must(t, err)
	missing, err := dedupe.NewSQLStore(d.Driver, dedupe.SQLConfig{Table: "not_migrated"})
	must(t, err)
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: missing}); !errors.Is(err, sqldb.ErrSchema) {
		t.Fatalf("New on a missing claims table = %v; want an error wrapping sqldb.ErrSchema", err)
	}
	present := claimsTable(t, d)
	if _, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: present}); err != nil {
		t.Fatalf("New on a migrated claims table: %v", err)
	}
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps})
	must(t, err)
	fn := func(context.Context, TTx, *message.Message, message.Publisher) error { return nil }
	if _, err := pipeline.HandleTx(p, "charge", "orders", ps, pipeline.TxConfig[TTx]{DB: d.Driver, Store: missing}, fn); !errors.Is(err, sqldb.ErrSchema) {
		t.Fatalf("HandleTx on a missing claims table = %v; want an error wrapping sqldb.ErrSchema", err)
	}
	if _, err := pipeline.HandleTx(p, "charge", "orders", ps, pipeline.TxConfig[TTx]{DB: d.Driver, Store: present}, fn); err != nil {
		t.Fatalf("HandleTx on a migrated claims table: %v", err)
	}
}

// A transactional handler whose outbox table is missing is refused when it
// is added, with the command that creates it.
func TestHandleTxChecksTheOutboxTable(t *testing.T) {
	t.Parallel()
	onEachDriver(t, checksTheOutboxTable[*sql.Tx], checksTheOutboxTable[pgx.Tx])
}

func checksTheOutboxTable[TTx any](t *testing.T, d db[TTx]) {
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	must(t, err)
	p, err := pipeline.New(router, pipeline.Config{Publisher: ps, Store: claimsTable(t, d)})
	must(t, err)
	name := testenv.Name(t, "nm")
	ob, err := outbox.New(d.Driver, outbox.Config{Topic: "nm_" + name[len(name)-8:]})
	must(t, err)
	t.Cleanup(func() {
		for _, tbl := range []string{ob.Table(), ob.Table() + "_relays"} {
			_, _ = d.sql.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+d.quote(tbl))
		}
	})
	fn := func(context.Context, TTx, *message.Message, message.Publisher) error { return nil }
	for _, batch := range []bool{false, true} {
		var err error
		cfg := pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: ob}
		if batch {
			cfg.Batch = pipeline.BatchConfig{MaxSize: 4}
			_, err = pipeline.HandleBatchTx(p, "charge", "orders", inFlight{n: 4}, cfg, func(context.Context, TTx, []*message.Message, message.Publisher) error { return nil })
		} else {
			_, err = pipeline.HandleTx(p, "charge", "orders", ps, cfg, fn)
		}
		if !errors.Is(err, sqldb.ErrSchema) || !strings.Contains(err.Error(), "TxConfig.Outbox") {
			t.Fatalf("HandleTx (batch %v) with a missing outbox table = %v; want an error wrapping sqldb.ErrSchema naming TxConfig.Outbox", batch, err)
		}
	}
	must(t, ob.InitSchema(t.Context()))
	if _, err := pipeline.HandleTx(p, "charge", "orders", ps, pipeline.TxConfig[TTx]{DB: d.Driver, Outbox: ob}, fn); err != nil {
		t.Fatalf("HandleTx with the outbox table made: %v", err)
	}
}
