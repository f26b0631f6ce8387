package pipeline_test

import (
	"context"
	"database/sql"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/pipeline"
)

// claimTracer counts the claims of one claims table pgx sends, by whether
// they are leases (synchronous_commit off for their own transaction).
type claimTracer struct {
	mu           sync.Mutex
	table        string
	lease, other int
}

func (c *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.table == "" || !strings.HasPrefix(d.SQL, `INSERT INTO "`+c.table+`"`) {
		return ctx
	}
	if strings.Contains(d.SQL, "'synchronous_commit', 'off'") {
		c.lease++
	} else {
		c.other++
	}
	return ctx
}

func (c *claimTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *claimTracer) counts() (lease, other int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lease, c.other
}

// The default transactional mode, which confirms every claim in its
// transaction, claims leases on PostgreSQL (dedupe.Config.ConfirmInTx); a
// plain handler, whose effects may be outside the database, never does.
func TestTxHandlerClaimsLeasesAndPlainHandlerDoesNot(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig(testenv.Require(t, testenv.PostgresURLEnv))
	must(t, err)
	tr := &claimTracer{}
	cfg.Tracer = tr
	pg := testenv.Postgres(t)
	pg.DB = stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pg.DB.Close() })
	e := newTxEnv(t, stdOf(pg))
	tr.mu.Lock()
	tr.table = e.claims
	tr.mu.Unlock()

	h := newHarness(t, e.store)
	_, err = pipeline.HandleTx(h.p, "charge", "orders", h.pubsub, pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver},
		func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO "+e.charges+" (order_id, cents) VALUES ($1, 1)", msg.UUID)
			return err
		})
	must(t, err)
	var plain atomic.Int64
	_, err = h.p.Handle("notify", "alerts", h.pubsub, func(*message.Message) error { plain.Add(1); return nil })
	must(t, err)
	h.run(t)

	must(t, h.pubsub.Publish("orders", message.NewMessage("order-1", []byte("A-1"))))
	waitFor(t, "the charge committed", func() bool { return e.rows(t) == 1 })
	if lease, other := tr.counts(); lease != 1 || other != 0 {
		t.Fatalf("transactional handler: %d lease claims, %d others; want one lease", lease, other)
	}
	must(t, h.pubsub.Publish("alerts", message.NewMessage("alert-1", nil)))
	waitFor(t, "the plain handler ran", func() bool { return plain.Load() == 1 })
	waitFor(t, "the plain handler's claim", func() bool { _, other := tr.counts(); return other == 1 })
	if lease, other := tr.counts(); lease != 1 || other != 1 {
		t.Fatalf("after the plain handler: %d lease claims, %d others; want its claim not a lease", lease, other)
	}
}
