package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// Section pgx: settle on pgx directly (dedupe.SQLStore on sqldb.Pgx, pipeline's pgx
// transactional handler) beside the same work through database/sql and the
// raw pgx floor, the same statements sent with pgx by hand.
const targetPgx = 0.9

// Sides of a pgx cell.
const (
	pgxFloor = "floor" // the statements sent with pgx directly
	pgxNat   = "pgx"   // settle on a pgxpool.Pool
	pgxStd   = "sql"   // settle through database/sql (pgx stdlib)
)

// Workloads of the pgx section.
const (
	pgxClaim = "store" // Claim, Confirm of a fresh key (no transaction)
	// ClaimConfirmedAll, in a transaction, of a batch of keys confirmed
	// earlier: a batch redelivered whole.
	pgxRedelivered = "redelivered-batch"
	pgxTxOne       = "tx-one"     // transactional handler, OneStatement: BEGIN; claim confirmed; INSERT; COMMIT
	pgxTxDefault   = "tx-default" // dedupe middleware + handler: claim; BEGIN; INSERT; confirm; COMMIT
)

var pgxWorkloads = []string{pgxClaim, pgxTxOne, pgxTxDefault, pgxRedelivered, pgxTxBatch}

// PgxResults: section pgx.
type PgxResults struct {
	Seconds float64  `json:"seconds_per_side"` // per side and cell, in Rounds turns
	Rounds  int      `json:"rounds"`
	Rows    []PgxRow `json:"rows"`
}

// PgxRow is one workload at one concurrency: msgs/s of each side over all
// its turns.
type PgxRow struct {
	Workload   string             `json:"workload"`
	Goroutines int                `json:"goroutines"`
	Rate       map[string]float64 `json:"msgs_per_s"`
}

// pgxBench is the state of the section: one database/sql pool and one pgx
// pool of the same size on the same server.
type pgxBench struct {
	*pg
	pool *pgxpool.Pool
}

// dupKeys is how many confirmed keys the redelivered-batch workload cycles
// through, redeliveredBatch at a time.
const (
	dupKeys          = 100_000
	redeliveredBatch = 16
)

func (b *pgxBench) op(ctx context.Context, workload, side string, g int) (func(ctx context.Context, key string) error, string, error) {
	if workload == pgxTxBatch {
		return b.batchOp(ctx, side, g)
	}
	sqlStore, ps, claims, effects, err := b.cellTables(ctx)
	if err != nil {
		return nil, "", err
	}
	t := `"` + claims + `"`
	now := pgNow
	// The store's statements, as dedupe writes them for PostgreSQL.
	claim := `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
VALUES ($1, 1, $2, 1, ` + now + ` + $3, ` + now + `)
ON CONFLICT (key) DO UPDATE SET state = 1, token = excluded.token, attempts = cur.attempts + 1,
	expires_at = excluded.expires_at, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts, expires_at`
	claimDone := `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
VALUES ($1, 2, $2, 1, 0, ` + now + `)
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts`
	readBack := `SELECT state, token, attempts, expires_at, ` + now + ` FROM ` + t + ` WHERE key = $1`
	confirm := `UPDATE ` + t + ` SET state = 2, token = '', expires_at = 0, updated_at = ` + now + ` WHERE key = $1 AND state = 1 AND token = $2`
	insert := "INSERT INTO " + effects + " (msg) VALUES ($1)"
	ttl := time.Minute.Microseconds()

	var store dedupe.Store = ps
	if side == pgxStd {
		store = sqlStore
	}
	switch workload {
	case pgxClaim:
		if side == pgxFloor {
			return func(ctx context.Context, key string) error {
				var attempts int
				var expires int64
				tok := randomID()
				if err := b.pool.QueryRow(ctx, claim, []byte(key), tok, ttl).Scan(&attempts, &expires); err != nil {
					return err
				}
				_, err := b.pool.Exec(ctx, confirm, []byte(key), tok)
				return err
			}, "", nil
		}
		return func(ctx context.Context, key string) error {
			c, err := store.Claim(ctx, key, time.Minute)
			if err != nil {
				return err
			}
			if c.Result != dedupe.Acquired {
				return fmt.Errorf("fresh key %s: %v", key, c.Result)
			}
			return store.Confirm(ctx, c)
		}, "", nil
	case pgxRedelivered:
		if _, err := b.pool.Exec(ctx, `INSERT INTO `+t+` (key, state, token, attempts, expires_at, updated_at)
SELECT convert_to('dup-' || i, 'UTF8'), 2, '', 1, 0, `+now+` FROM generate_series(0, $1 - 1) AS i`, dupKeys); err != nil {
			return nil, "", err
		}
		// A batch of redeliveredBatch keys confirmed earlier, as when a
		// whole batch comes back after a crash between commit and ack.
		keys := func(key string) []string {
			i := strings.LastIndexByte(key, '-')
			n, _ := strconv.Atoi(key[i+1:])
			ks := make([]string, redeliveredBatch)
			for j := range ks {
				ks[j] = fmt.Sprintf("dup-%d", (n*redeliveredBatch+j)%dupKeys)
			}
			slices.Sort(ks)
			return ks
		}
		check := func(cs []dedupe.Claim) error {
			for _, c := range cs {
				if c.Result != dedupe.Duplicate {
					return fmt.Errorf("confirmed key %s: %v", c.Key, c.Result)
				}
			}
			return nil
		}
		switch side {
		case pgxFloor:
			return func(ctx context.Context, key string) error {
				ks := keys(key)
				return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					bk, err := rawClaimAll(ctx, tx, t, ks)
					if err != nil {
						return err
					}
					var batch pgx.Batch
					for _, k := range bk {
						batch.Queue(readBack, k)
					}
					br := tx.SendBatch(ctx, &batch)
					for range bk {
						var st, att int
						var tok string
						var exp, nw int64
						if err := br.QueryRow().Scan(&st, &tok, &att, &exp, &nw); err != nil {
							_ = br.Close()
							return err
						}
					}
					return br.Close()
				})
			}, "", nil
		case pgxNat:
			return func(ctx context.Context, key string) error {
				return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					cs, err := ps.WithTx(tx).ClaimConfirmedAll(ctx, keys(key))
					if err != nil {
						return err
					}
					return check(cs)
				})
			}, "", nil
		default:
			return func(ctx context.Context, key string) error {
				tx, err := b.db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback() }()
				cs, err := sqlStore.WithTx(tx).ClaimConfirmedAll(ctx, keys(key))
				if err != nil {
					return err
				}
				if err := check(cs); err != nil {
					return err
				}
				return tx.Commit()
			}, "", nil
		}
	case pgxTxOne:
		switch side {
		case pgxFloor:
			return func(ctx context.Context, key string) error {
				return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					var attempts int
					if err := tx.QueryRow(ctx, claimDone, []byte(key), randomID()).Scan(&attempts); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, insert, key)
					return err
				})
			}, effects, nil
		case pgxNat:
			h, err := pipeline.NewTxHandler(pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(b.pool), OneStatement: true, Store: ps},
				func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ message.Publisher) error {
					_, err := tx.Exec(ctx, insert, msg.UUID)
					return err
				})
			if err != nil {
				return nil, "", err
			}
			return msgOp(h), effects, nil
		default:
			h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(b.db, sqldb.Postgres), OneStatement: true, Store: sqlStore}, sqlEffect(insert))
			if err != nil {
				return nil, "", err
			}
			return msgOp(h), effects, nil
		}
	default: // pgxTxDefault
		var h message.NoPublishHandlerFunc
		switch side {
		case pgxFloor:
			return func(ctx context.Context, key string) error {
				var attempts int
				var expires int64
				tok := randomID()
				if err := b.pool.QueryRow(ctx, claim, []byte(key), tok, ttl).Scan(&attempts, &expires); err != nil {
					return err
				}
				return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, insert, key); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, confirm, []byte(key), tok)
					return err
				})
			}, effects, nil
		case pgxNat:
			h, err = pipeline.NewTxHandler(pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(b.pool)},
				func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ message.Publisher) error {
					_, err := tx.Exec(ctx, insert, msg.UUID)
					return err
				})
		default:
			h, err = pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(b.db, sqldb.Postgres)}, sqlEffect(insert))
		}
		if err != nil {
			return nil, "", err
		}
		dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
		if err != nil {
			return nil, "", err
		}
		wrapped := dd(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
		return func(ctx context.Context, key string) error {
			msg := message.NewMessage(key, nil)
			msg.SetContext(ctx)
			_, err := wrapped(msg)
			return err
		}, effects, nil
	}
}

func sqlEffect(insert string) pipeline.TxFunc[*sql.Tx] {
	return func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		_, err := tx.ExecContext(ctx, insert, msg.UUID)
		return err
	}
}

func msgOp(h message.NoPublishHandlerFunc) func(ctx context.Context, key string) error {
	return func(ctx context.Context, key string) error {
		msg := message.NewMessage(key, nil)
		msg.SetContext(ctx)
		return h(msg)
	}
}

// pgxSlice is one turn of one side in a cell. The sides of a cell take
// turns, in a random order each round, so that a change of the machine's
// load (other work on the shared cores) falls on all three alike.
const pgxSlice = 300 * time.Millisecond

func runPgx(ctx context.Context, o options, log io.Writer) (*PgxResults, error) {
	rounds := 10 * o.runs
	const conns = 16
	p, err := openPG(ctx, o.pgURL, conns)
	if err != nil {
		return nil, err
	}
	defer p.close()
	cfg, err := pgxpool.ParseConfig(o.pgURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns, cfg.MinConns = conns, conns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	b := &pgxBench{pg: p, pool: pool}
	res := &PgxResults{Seconds: pgxSlice.Seconds() * float64(rounds), Rounds: rounds}
	type side struct {
		name    string
		op      func(ctx context.Context, key string) error
		effects string
		n       int
		el      time.Duration
	}
	for _, w := range pgxWorkloads {
		for _, g := range []int{1, 4, 16} {
			if w == pgxTxBatch && g == 1 {
				continue // a batch needs deliveries in flight together
			}
			var sides []*side
			for _, name := range []string{pgxFloor, pgxNat, pgxStd} {
				op, effects, err := b.op(ctx, w, name, g)
				if err != nil {
					return nil, fmt.Errorf("%s %s: %w", w, name, err)
				}
				sides = append(sides, &side{name: name, op: op, effects: effects})
			}
			for range rounds {
				for _, i := range rand.Perm(len(sides)) {
					sd := sides[i]
					n, el, err := forDuration(ctx, g, pgxSlice, "pgx-"+randomID()+"-", sd.op)
					if err != nil {
						return nil, fmt.Errorf("%s %s g=%d: %w", w, sd.name, g, err)
					}
					sd.n += n
					sd.el += el
				}
			}
			row := PgxRow{Workload: w, Goroutines: g, Rate: map[string]float64{}}
			for _, sd := range sides {
				if sd.effects != "" {
					if err := p.checkEffects(ctx, sd.effects, sd.n); err != nil {
						return nil, err
					}
				}
				rate := float64(sd.n) / sd.el.Seconds()
				if w == pgxRedelivered {
					rate *= redeliveredBatch // messages, not batches
				}
				row.Rate[sd.name] = rate
				fmt.Fprintf(log, "%s g=%d %s: %.0f msgs/s\n", w, g, sd.name, rate)
			}
			res.Rows = append(res.Rows, row)
		}
	}
	return res, nil
}

func pgxTable(r *PgxResults) string {
	if r == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| workload | goroutines | raw pgx floor | settle on pgx | settle on database/sql | pgx/floor | pgx/database/sql |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, row := range r.Rows {
		fl, nat, std := row.Rate[pgxFloor], row.Rate[pgxNat], row.Rate[pgxStd]
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %s |\n", row.Workload, row.Goroutines, num(fl), num(nat), num(std),
			verdict(ratio(nat, fl), targetPgx), x(ratio(nat, std)))
	}
	return b.String()
}

// rawClaimAll is the floor's claim of keys as confirmed in one statement,
// the statement dedupe's ClaimConfirmedAll sends on PostgreSQL, written by
// hand. table is quoted. It returns the keys as bytes.
func rawClaimAll(ctx context.Context, tx pgx.Tx, table string, keys []string) ([][]byte, error) {
	bk := make([][]byte, len(keys))
	for i, k := range keys {
		bk[i] = []byte(k)
	}
	now := pgNow
	rows, err := tx.Query(ctx, `INSERT INTO `+table+` AS cur (key, state, token, attempts, expires_at, updated_at)
SELECT k, 2, $2, 1, 0, `+now+` FROM unnest($1::bytea[]) AS k
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING key, attempts`, bk, randomID())
	if err != nil {
		return nil, err
	}
	rows.Close()
	return bk, rows.Err()
}

// pgNow is the claims table's clock on PostgreSQL, as dedupe writes it:
// microseconds since the epoch at the statement's start.
const pgNow = `(extract(epoch from statement_timestamp()) * 1000000)::bigint`

// cellTables makes one cell's claims and effect tables, and the two stores
// on the claims table.
func (b *pgxBench) cellTables(ctx context.Context) (sqlStore *dedupe.SQLStore[*sql.Tx], ps *dedupe.SQLStore[pgx.Tx], claims, effects string, err error) {
	if sqlStore, claims, err = b.dedupeTable(ctx); err != nil {
		return nil, nil, "", "", err
	}
	if effects, err = b.effectTable(ctx); err != nil {
		return nil, nil, "", "", err
	}
	if ps, err = dedupe.NewSQLStore(sqldb.Pgx(b.pool), dedupe.SQLConfig{Table: claims}); err != nil {
		return nil, nil, "", "", err
	}
	return sqlStore, ps, claims, effects, nil
}
