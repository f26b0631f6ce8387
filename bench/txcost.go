package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// Transactional modes on PostgreSQL.
const (
	txRaw     = "raw"           // BEGIN; INSERT effect; COMMIT
	txRawKey  = "raw+key"       // BEGIN; INSERT key ON CONFLICT DO NOTHING; INSERT effect; COMMIT
	txOne     = "one-statement" // BEGIN; ClaimConfirmed; INSERT effect; COMMIT
	txDefault = "default"       // Claim; BEGIN; INSERT effect; Confirm; COMMIT
)

var txModes = []string{txRaw, txRawKey, txOne, txDefault}

// TxCostResults: section txcost.
type TxCostResults struct {
	Seconds float64     `json:"seconds_per_cell"`
	Rows    []TxCostRow `json:"rows"`
}

// TxCostRow is one concurrency: median msgs/s of each mode.
type TxCostRow struct {
	Goroutines int                `json:"goroutines"`
	Rate       map[string]float64 `json:"msgs_per_s"`
}

func randomID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// pg is a PostgreSQL database with the tables one section creates, dropped
// by close.
type pg struct {
	db     *sql.DB
	tables []string
}

func openPG(ctx context.Context, url string, conns int) (*pg, error) {
	db, d, err := sqlurl.Open(url)
	if err != nil {
		return nil, err
	}
	if d != sqldb.Postgres {
		_ = db.Close()
		return nil, fmt.Errorf("SETTLE_POSTGRES_URL is not a PostgreSQL URL")
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return &pg{db: db}, nil
}

// dedupeTable creates a claims table and returns its store.
func (p *pg) dedupeTable(ctx context.Context) (*dedupe.SQLStore[*sql.Tx], string, error) {
	name := "bench_claims_" + randomID()
	store, err := dedupe.NewSQLStore(sqldb.Std(p.db, sqldb.Postgres), dedupe.SQLConfig{Table: name})
	if err != nil {
		return nil, "", err
	}
	ddl := store.Schema()
	p.tables = append(p.tables, name)
	for _, s := range ddl {
		if _, err := p.db.ExecContext(ctx, s); err != nil {
			return nil, "", err
		}
	}
	return store, name, nil
}

// effectTable creates a table of effects: one row per handled message, no
// unique constraint on the message, so a duplicate effect would show.
func (p *pg) effectTable(ctx context.Context) (string, error) {
	name := "bench_effects_" + randomID()
	p.tables = append(p.tables, name)
	_, err := p.db.ExecContext(ctx, "CREATE TABLE "+name+" (id BIGSERIAL PRIMARY KEY, msg TEXT NOT NULL)")
	return name, err
}

// checkEffects reports an error unless table holds exactly want rows, one per
// distinct message.
func (p *pg) checkEffects(ctx context.Context, table string, want int) error {
	var rows, distinct int
	if err := p.db.QueryRowContext(ctx, "SELECT COUNT(*), COUNT(DISTINCT msg) FROM "+table).Scan(&rows, &distinct); err != nil {
		return err
	}
	if rows != want || distinct != want {
		return fmt.Errorf("%s: %d effect rows for %d distinct messages, want exactly one for each of %d", table, rows, distinct, want)
	}
	return nil
}

func (p *pg) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, t := range p.tables {
		_, _ = p.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t)
	}
	_ = p.db.Close()
}

// txOp returns the per-message work of mode on the effect table.
func txOp(p *pg, store *dedupe.SQLStore[*sql.Tx], claims, effects, mode string) func(ctx context.Context, key string) error {
	insert := "INSERT INTO " + effects + " (msg) VALUES ($1)"
	effect := func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		_, err := tx.ExecContext(ctx, insert, msg.UUID)
		return err
	}
	switch mode {
	case txRaw:
		return func(ctx context.Context, key string) error {
			tx, err := p.db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, insert, key); err != nil {
				_ = tx.Rollback()
				return err
			}
			return tx.Commit()
		}
	case txRawKey:
		// The same rows as one-statement, without settle: the key into a
		// table of the claims table's shape, then the effect.
		claim := `INSERT INTO "` + claims + `" (key, state, token, attempts, expires_at, updated_at) VALUES ($1, 2, '', 1, 0, $2) ON CONFLICT DO NOTHING`
		return func(ctx context.Context, key string) error {
			tx, err := p.db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, claim, []byte(key), time.Now().UnixMicro()); err != nil {
				_ = tx.Rollback()
				return err
			}
			if _, err := tx.ExecContext(ctx, insert, key); err != nil {
				_ = tx.Rollback()
				return err
			}
			return tx.Commit()
		}
	case txOne:
		h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(p.db, sqldb.Postgres), OneStatement: true, Store: store}, effect)
		if err != nil {
			panic(err) // a valid configuration
		}
		return func(ctx context.Context, key string) error {
			msg := message.NewMessage(key, nil)
			msg.SetContext(ctx)
			return h(msg)
		}
	default:
		return func(ctx context.Context, key string) (err error) {
			c, err := store.Claim(ctx, key, time.Minute)
			if err != nil {
				return err
			}
			if c.Result != dedupe.Acquired {
				return fmt.Errorf("fresh key %s: %v", key, c.Result)
			}
			tx, err := p.db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer func() {
				if err != nil {
					_ = tx.Rollback()
				}
			}()
			if err = effect(ctx, tx, message.NewMessage(key, nil), nil); err != nil {
				return err
			}
			if err = store.WithTx(tx).Confirm(ctx, c); err != nil {
				return err
			}
			return tx.Commit()
		}
	}
}

// forDuration runs op from g goroutines, each with fresh keys, for d, and
// returns how many ops completed and the elapsed time.
func forDuration(ctx context.Context, g int, d time.Duration, prefix string, op func(ctx context.Context, key string) error) (int, time.Duration, error) {
	var (
		next    atomic.Int64
		stop    atomic.Bool
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
	)
	start := time.Now()
	timer := time.AfterFunc(d, func() { stop.Store(true) })
	defer timer.Stop()
	for range g {
		wg.Go(func() {
			for !stop.Load() && ctx.Err() == nil {
				i := next.Add(1)
				if err := op(ctx, prefix+strconv.FormatInt(i, 10)); err != nil {
					errOnce.Do(func() { first = err })
					stop.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if first == nil {
		first = ctx.Err()
	}
	// Ops started before the stop and finished after it count: next is the
	// number started, all of them completed.
	return int(next.Load()), elapsed, first
}

func runTxCost(ctx context.Context, o options, log io.Writer) (*TxCostResults, error) {
	d := 3 * time.Second
	if o.quick {
		d = time.Second
	}
	p, err := openPG(ctx, o.pgURL, 16)
	if err != nil {
		return nil, err
	}
	defer p.close()
	res := &TxCostResults{Seconds: d.Seconds()}
	for _, g := range []int{1, 4, 16} {
		rates := map[string][]float64{}
		for r := range o.runs {
			for _, mode := range txModes {
				store, claims, err := p.dedupeTable(ctx)
				if err != nil {
					return nil, err
				}
				effects, err := p.effectTable(ctx)
				if err != nil {
					return nil, err
				}
				n, el, err := forDuration(ctx, g, d, "tx-"+randomID()+"-", txOp(p, store, claims, effects, mode))
				if err != nil {
					return nil, fmt.Errorf("%s g=%d: %w", mode, g, err)
				}
				if err := p.checkEffects(ctx, effects, n); err != nil {
					return nil, err
				}
				rate := float64(n) / el.Seconds()
				fmt.Fprintf(log, "run %d g=%d %s: %.0f msgs/s\n", r+1, g, mode, rate)
				rates[mode] = append(rates[mode], rate)
			}
		}
		row := TxCostRow{Goroutines: g, Rate: map[string]float64{}}
		for _, m := range txModes {
			row.Rate[m] = median(rates[m])
		}
		res.Rows = append(res.Rows, row)
	}
	return res, nil
}
