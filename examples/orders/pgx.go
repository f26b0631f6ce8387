package main

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// openDB opens the run's database. A postgres:// URL gets a pgxpool.Pool,
// which settle uses directly, through sqldb.Pgx (the store, the outbox and
// the transactional handler on pgx.Tx), and a *sql.DB over the same pool
// for the example's own bookkeeping (schema, counts): one pool, not two.
// Other URLs get database/sql alone, and pool is nil. minConns, when
// above the pool's own limit, raises it.
func openDB(ctx context.Context, u string, minConns int32) (db *sql.DB, d sqldb.Dialect, pool *pgxpool.Pool, err error) {
	_, _, d, err = sqlurl.Parse(u)
	if err != nil {
		return nil, "", nil, err
	}
	if d != sqldb.Postgres {
		db, d, err = sqlurl.Open(u)
		return db, d, nil, err
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, "", nil, fmt.Errorf("database postgres: %w", err)
	}
	cfg.MaxConns = max(cfg.MaxConns, minConns)
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, "", nil, fmt.Errorf("database postgres: %w", err)
	}
	return stdlib.OpenDBFromPool(pool), d, pool, nil
}

// chargedEvent is the "charged" event of an order, continuing ctx's trace.
func chargedEvent(ctx context.Context, o orderPlaced) (*message.Message, error) {
	ev, err := pipeline.NewMessage("charged-"+o.OrderID, nil, orderCharged{OrderID: o.OrderID, Email: o.Email})
	if err != nil {
		return nil, err
	}
	ev.SetContext(ctx)
	return ev, nil
}

// chargePgx is the charge handler on pgx: the charge row and the "charged"
// event commit in the handler's pgx.Tx, with the dedupe confirmation.
func chargePgx(s *schema, topic string) pipeline.TxFunc[pgx.Tx] {
	return pipeline.TypedTx(nil, func(ctx context.Context, tx pgx.Tx, m pipeline.Message[orderPlaced], out message.Publisher) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.charges+" (order_id, cents) VALUES ($1, $2)", m.Body.OrderID, m.Body.Cents); err != nil {
			return err
		}
		ev, err := chargedEvent(ctx, m.Body)
		if err != nil {
			return err
		}
		return out.Publish(topic, ev)
	})
}

// placeOrderPgx is placeOrder in a pgx transaction: the order row and its
// "placed" event in the outbox (TxPublisher on the pgx.Tx) commit together.
func placeOrderPgx(ctx context.Context, tracer trace.Tracer, pool *pgxpool.Pool, ob *outbox.Outbox[pgx.Tx], s *schema, topic string, o orderPlaced) (*message.Message, error) {
	ctx, span := tracer.Start(ctx, "place order", trace.WithAttributes(attribute.String("order.id", o.OrderID)))
	defer span.End()
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+s.orders+" (id, cents) VALUES ($1, $2)", o.OrderID, o.Cents); err != nil {
		return nil, err
	}
	msg, err := publishPlaced(ctx, ob, tx, topic, o)
	if err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, err
	}
	ob.Notify() // the relay of this process forwards at once
	return msg, nil
}
