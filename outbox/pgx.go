package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/sqldb"
)

// The pgx path: an application on pgx (a pgxpool.Pool, a pgx.Tx) uses the
// outbox without a database/sql pool. The statements are the same ones the
// *sql.DB functions run; only the driver under them differs (see conn). All of
// it is PostgreSQL only: an Outbox of another dialect refuses.

// errPgxDialect is returned by the pgx functions of an Outbox that is not
// configured for PostgreSQL.
func (o *Outbox) errPgxDialect(fn string) error {
	if o.cfg.Dialect == sqldb.Postgres {
		return nil
	}
	return fmt.Errorf("outbox: %s: pgx is PostgreSQL only, and this outbox's Config.Dialect is %q", fn, string(o.cfg.Dialect))
}

// pgxConn is the conn of a pgx pool. The relay's LISTEN takes one connection
// of the pool and closes it when it stops.
func pgxConn(pool *pgxpool.Pool) conn {
	return conn{
		Beginner: wsql.BeginnerFromPgx(pool),
		listen: func(ctx context.Context, channel string, wake func()) error {
			c, err := pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer func() {
				// LISTENing (or broken): take it out of the pool and close it.
				cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_ = c.Hijack().Close(cctx)
			}()
			return listenOn(ctx, c.Conn(), channel, wake)
		},
		maxConns: func() int { return int(pool.Stat().MaxConns()) },
	}
}

// PgxTxPublisher is TxPublisher for a pgx.Tx: the same rows, trace context
// and "create" spans, and on PostgreSQL the same pg_notify, written on tx,
// so that they commit or roll back with it. The Outbox must be configured
// for sqldb.Postgres.
func (o *Outbox) PgxTxPublisher(tx pgx.Tx) (message.Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: PgxTxPublisher: tx is nil")
	}
	if err := o.errPgxDialect("PgxTxPublisher"); err != nil {
		return nil, err
	}
	return o.Publisher(wsql.TxFromPgx(tx))
}

// NewPgxRelay is NewRelay on a pgx pool: the relay's batches, polls and
// heartbeats run on pool, and its LISTEN holds one connection of pool for as
// long as it runs (closed, not returned, when it stops), so the pool must
// allow at least two (pgxpool's MaxConns; with one the relay polls). The
// relay does not own pool or out: closing it leaves them open.
func (o *Outbox) NewPgxRelay(pool *pgxpool.Pool, out message.Publisher, cfg RelayConfig) (*Relay, error) {
	if pool == nil || out == nil {
		return nil, errors.New("outbox: NewPgxRelay: pool and out are required")
	}
	if err := o.errPgxDialect("NewPgxRelay"); err != nil {
		return nil, err
	}
	return o.newRelay("NewPgxRelay", pgxConn(pool), out, cfg)
}

// PgxForward is Forward on a pgx pool.
func (o *Outbox) PgxForward(ctx context.Context, pool *pgxpool.Pool, out message.Publisher, cfg RelayConfig) (int64, error) {
	r, err := o.NewPgxRelay(pool, out, cfg)
	if err != nil {
		return 0, err
	}
	return forward(ctx, r)
}

// PgxStatus is Status on a pgx pool.
func (o *Outbox) PgxStatus(ctx context.Context, pool *pgxpool.Pool) (Status, error) {
	if pool == nil {
		return Status{}, errors.New("outbox: PgxStatus: pool is nil")
	}
	if err := o.errPgxDialect("PgxStatus"); err != nil {
		return Status{}, err
	}
	return o.status(ctx, pgxConn(pool))
}

// PgxCheck is Check on a pgx pool.
func (o *Outbox) PgxCheck(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("outbox: PgxCheck: pool is nil")
	}
	if err := o.errPgxDialect("PgxCheck"); err != nil {
		return err
	}
	return o.check(ctx, pgxConn(pool))
}

// PgxPrune is Prune on a pgx pool.
func (o *Outbox) PgxPrune(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration) (int64, error) {
	if pool == nil {
		return 0, errors.New("outbox: PgxPrune: pool is nil")
	}
	if err := o.errPgxDialect("PgxPrune"); err != nil {
		return 0, err
	}
	return o.prune(ctx, pgxConn(pool), olderThan)
}

// PgxInitSchema is InitSchema on a pgx pool. Never call it inside an
// application transaction.
func (o *Outbox) PgxInitSchema(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("outbox: PgxInitSchema: pool is nil")
	}
	if err := o.errPgxDialect("PgxInitSchema"); err != nil {
		return err
	}
	return o.initSchema(ctx, pgxConn(pool))
}
