package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// GrowthResults: section growth.
type GrowthResults struct {
	Stack      []GrowthRow `json:"stack"`    // GoChannel, memory store
	PG         []GrowthRow `json:"postgres"` // claim+confirm, fresh table
	Goroutines int         `json:"pg_goroutines"`
	Prefilled  Prefilled   `json:"prefilled"`
}

// GrowthRow is the cost per message at one message count.
type GrowthRow struct {
	N    int                `json:"n"`
	USMs map[string]float64 `json:"us_per_msg"`
}

// Prefilled is the claim+confirm cost on a table holding Rows confirmed keys,
// and the cost of pruning them.
type Prefilled struct {
	Rows        int     `json:"rows"`
	FillSeconds float64 `json:"fill_seconds"`
	N           int     `json:"n"`
	EmptyUS     float64 `json:"empty_us_per_msg"`
	FullUS      float64 `json:"full_us_per_msg"`
	Pruned      int64   `json:"pruned"`
	PruneSecs   float64 `json:"prune_seconds"`
}

func runGrowth(ctx context.Context, o options, log io.Writer) (*GrowthResults, error) {
	counts := []int{1_000, 10_000, 100_000}
	fill := 1_000_000
	if o.quick {
		counts = []int{1_000, 10_000}
		fill = 100_000
	}
	const g = 16
	res := &GrowthResults{Goroutines: g}
	for _, n := range counts {
		row := GrowthRow{N: n, USMs: map[string]float64{}}
		for _, mode := range []string{modeBare, modeSettle} {
			var us []float64
			for range o.runs {
				s, err := stackRun(ctx, mode, n, dedupe.NewMemoryStore(), "")
				if err != nil {
					return nil, err
				}
				us = append(us, 1e6/s.Rate)
			}
			row.USMs[mode] = median(us)
			fmt.Fprintf(log, "stack %s n=%d: %.2f µs/msg\n", mode, n, row.USMs[mode])
		}
		res.Stack = append(res.Stack, row)
	}
	p, err := openPG(ctx, o.pgURL, g)
	if err != nil {
		return nil, err
	}
	defer p.close()
	claimConfirm := func(store *dedupe.SQLStore[*sql.Tx]) func(ctx context.Context, key string) error {
		return func(ctx context.Context, key string) error {
			c, err := store.Claim(ctx, key, time.Minute)
			if err != nil {
				return err
			}
			if c.Result != dedupe.Acquired {
				return fmt.Errorf("fresh key %s: %v", key, c.Result)
			}
			return store.Confirm(ctx, c)
		}
	}
	for _, n := range counts {
		store, _, err := p.dedupeTable(ctx)
		if err != nil {
			return nil, err
		}
		el, err := forCount(ctx, g, n, "grow-", claimConfirm(store))
		if err != nil {
			return nil, err
		}
		us := el.Seconds() * 1e6 / float64(n)
		fmt.Fprintf(log, "postgres store n=%d: %.1f µs/msg\n", n, us)
		res.PG = append(res.PG, GrowthRow{N: n, USMs: map[string]float64{"postgres": us}})
	}

	// A table with fill confirmed keys, against an empty one.
	pf := Prefilled{Rows: fill, N: 10_000}
	if o.quick {
		pf.N = 2_000
	}
	empty, _, err := p.dedupeTable(ctx)
	if err != nil {
		return nil, err
	}
	el, err := forCount(ctx, g, pf.N, "empty-", claimConfirm(empty))
	if err != nil {
		return nil, err
	}
	pf.EmptyUS = el.Seconds() * 1e6 / float64(pf.N)
	full, table, err := p.dedupeTable(ctx)
	if err != nil {
		return nil, err
	}
	old := time.Now().Add(-48 * time.Hour).UnixMicro()
	start := time.Now()
	if _, err := p.db.ExecContext(ctx, `INSERT INTO "`+table+`" (key, state, token, attempts, expires_at, updated_at)
SELECT convert_to('fill-0000-0000-0000-' || g, 'UTF8'), 2, '', 1, 0, $1 FROM generate_series(1, $2::int) AS g`, old, fill); err != nil {
		return nil, fmt.Errorf("fill: %w", err)
	}
	if _, err := p.db.ExecContext(ctx, `ANALYZE "`+table+`"`); err != nil {
		return nil, err
	}
	pf.FillSeconds = time.Since(start).Seconds()
	fmt.Fprintf(log, "filled %d rows in %.1fs\n", fill, pf.FillSeconds)
	el, err = forCount(ctx, g, pf.N, "full-", claimConfirm(full))
	if err != nil {
		return nil, err
	}
	pf.FullUS = el.Seconds() * 1e6 / float64(pf.N)
	fmt.Fprintf(log, "claim+confirm: empty table %.1f µs/msg, %d rows %.1f µs/msg\n", pf.EmptyUS, fill, pf.FullUS)
	// Prune what is older than an hour: the filled rows, not the fresh ones.
	start = time.Now()
	pf.Pruned, err = full.Prune(ctx, time.Now().Add(-time.Hour))
	if err != nil {
		return nil, err
	}
	pf.PruneSecs = time.Since(start).Seconds()
	if pf.Pruned != int64(fill) {
		return nil, fmt.Errorf("prune removed %d rows, want %d", pf.Pruned, fill)
	}
	fmt.Fprintf(log, "pruned %d rows in %.1fs\n", pf.Pruned, pf.PruneSecs)
	res.Prefilled = pf
	return res, nil
}

// forCount runs op n times in all from g goroutines, with fresh keys, and
// returns the elapsed time.
func forCount(ctx context.Context, g, n int, prefix string, op func(ctx context.Context, key string) error) (time.Duration, error) {
	var (
		next    atomic.Int64
		failed  atomic.Bool
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
	)
	prefix += randomID() + "-"
	start := time.Now()
	for range g {
		wg.Go(func() {
			for !failed.Load() {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if err := op(ctx, prefix+strconv.FormatInt(i, 10)); err != nil {
					errOnce.Do(func() { first = err })
					failed.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start), first
}
