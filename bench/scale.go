package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/sqldb"
)

// ScaleResults: section scale. Claim + confirm on a claims table that
// already holds millions of confirmed keys, and the prune of a day of them,
// on PostgreSQL and MariaDB.
type ScaleResults struct {
	Workers int        `json:"workers"`
	Seconds float64    `json:"seconds"` // per claim+confirm measurement
	Days    int        `json:"days"`    // the filled keys span this many days
	Runs    []ScaleRun `json:"runs"`
}

// ScaleRun is one database, one table layout, one size.
type ScaleRun struct {
	DB          string  `json:"db"`
	Layout      string  `json:"layout"` // "table" or "partitioned"
	Rows        int     `json:"rows"`
	FillSeconds float64 `json:"fill_seconds"`
	TableMB     float64 `json:"table_mb"`
	IndexMB     float64 `json:"index_mb"`
	OpsPerSec   float64 `json:"ops_per_sec"` // claim+confirm pairs
	P50MS       float64 `json:"p50_ms"`
	P99MS       float64 `json:"p99_ms"`
	// The prune of the oldest day while the workers go on claiming.
	PruneRows    int64   `json:"prune_rows"`
	PruneSeconds float64 `json:"prune_seconds"`
	PruneP50MS   float64 `json:"prune_p50_ms"` // claim+confirm while the prune runs
	PruneP99MS   float64 `json:"prune_p99_ms"`
	PruneOps     int     `json:"prune_ops"`
	// Dead is, right after the prune, pg_stat_user_tables.n_dead_tup of the
	// table (PostgreSQL) or InnoDB's history list length (MariaDB, the whole
	// server's); DeadBefore the same before it.
	Dead         int64   `json:"dead"`
	DeadBefore   int64   `json:"dead_before"`
	TableMBAfter float64 `json:"table_mb_after"`
	IndexMBAfter float64 `json:"index_mb_after"`
}

const (
	scaleDays  = 7
	scaleChunk = 1_000_000
)

// runScale measures the layouts of o.scaleLayouts; the runs of prev whose
// layout is not measured this time are kept.
func runScale(ctx context.Context, o options, prev *ScaleResults, log io.Writer) (*ScaleResults, error) {
	sizes := []int{1_000_000, 10_000_000}
	res := &ScaleResults{Workers: 8, Seconds: 10, Days: scaleDays}
	if o.quick {
		sizes = []int{100_000}
		res.Seconds = 3
	}
	if len(o.scaleSizes) > 0 {
		sizes = o.scaleSizes
	}
	for _, target := range []struct{ name, url string }{{"postgres", o.pgURL}, {"mariadb", o.mysqlURL}} {
		for _, layout := range scaleLayouts {
			if !slices.Contains(o.scaleLayouts, layout.name) || !slices.Contains(o.scaleDBs, target.name) {
				if prev != nil && prev.Workers == res.Workers && prev.Seconds == res.Seconds {
					for _, r := range prev.Runs {
						if r.DB == target.name && r.Layout == layout.name {
							res.Runs = append(res.Runs, r)
						}
					}
				}
				continue
			}
			for _, n := range sizes {
				r, err := scaleRun(ctx, target.name, target.url, layout, n, res, log)
				if err != nil {
					return nil, fmt.Errorf("%s %s %d: %w", target.name, layout.name, n, err)
				}
				res.Runs = append(res.Runs, r)
			}
		}
	}
	return res, nil
}

// scaleLayout is a way to lay out the claims table.
type scaleLayout struct {
	name string
	cfg  func(table string) dedupe.SQLConfig
}

var scaleLayouts = []scaleLayout{
	{"table", func(table string) dedupe.SQLConfig { return dedupe.SQLConfig{Table: table} }},
	{"partitioned", func(table string) dedupe.SQLConfig {
		return dedupe.SQLConfig{Table: table, Partition: 24 * time.Hour}
	}},
}

func scaleRun(ctx context.Context, name, url string, layout scaleLayout, n int, res *ScaleResults, log io.Writer) (ScaleRun, error) {
	out := ScaleRun{DB: name, Layout: layout.name, Rows: n}
	db, d, err := sqlurl.Open(url)
	if err != nil {
		return out, err
	}
	defer db.Close()
	db.SetMaxOpenConns(res.Workers + 2)
	db.SetMaxIdleConns(res.Workers + 2)
	table := "bench_scale_" + randomID()
	store, err := dedupe.NewSQLStore(sqldb.Std(db, d), layout.cfg(table))
	if err != nil {
		return out, err
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if _, err := db.ExecContext(c, "DROP TABLE IF EXISTS "+table); err != nil {
			fmt.Fprintf(log, "drop %s: %v\n", table, err)
		}
	}()
	for _, stmt := range store.Schema() {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return out, fmt.Errorf("schema: %w", err)
		}
	}
	// The keys span the scaleDays days before today (UTC), oldest first,
	// each the MD5 of its number in hex (32 bytes, a UUID's size, spread
	// over the index as message IDs are).
	now := time.Now()
	base := now.Truncate(24 * time.Hour).Add(-scaleDays * 24 * time.Hour).UnixMicro()
	step := (scaleDays * 24 * time.Hour).Microseconds() / int64(n)
	partitioned := layout.name == "partitioned"
	if partitioned {
		// A partition a day, from the oldest key's on.
		if err := store.AddPartitions(ctx, time.UnixMicro(base), now.Add(24*time.Hour)); err != nil {
			return out, err
		}
	}
	start := time.Now()
	if d == sqldb.MySQL {
		if err := scaleFillMariaDB(ctx, db, table, store.Schema(), partitioned, n, base, step); err != nil {
			return out, fmt.Errorf("fill: %w", err)
		}
	}
	for lo := 1; lo <= n && d != sqldb.MySQL; lo += scaleChunk {
		hi := min(lo+scaleChunk-1, n)
		if err := scaleFill(ctx, db, d, table, partitioned, lo, hi, base, step); err != nil {
			return out, fmt.Errorf("fill: %w", err)
		}
	}
	if err := scaleAnalyze(ctx, db, d, table); err != nil {
		return out, err
	}
	out.FillSeconds = time.Since(start).Seconds()
	if out.TableMB, out.IndexMB, err = scaleSize(ctx, db, d, table); err != nil {
		return out, err
	}
	fmt.Fprintf(log, "%s %s: %d rows filled in %.0fs, table %.0f MB, indexes %.0f MB\n", name, layout.name, n, out.FillSeconds, out.TableMB, out.IndexMB)

	dur := time.Duration(res.Seconds * float64(time.Second))
	lat, el, err := scaleLoad(ctx, store, res.Workers, func(el time.Duration) bool { return el >= dur })
	if err != nil {
		return out, err
	}
	out.OpsPerSec = float64(len(lat)) / el.Seconds()
	out.P50MS, out.P99MS = percentile(lat, 50), percentile(lat, 99)
	fmt.Fprintf(log, "%s %s %d: claim+confirm %.0f/s, p50 %.2f ms, p99 %.2f ms\n", name, layout.name, n, out.OpsPerSec, out.P50MS, out.P99MS)

	// Prune the oldest day while the workers go on.
	if out.DeadBefore, err = scaleDead(ctx, db, d, table); err != nil {
		return out, err
	}
	cutoff := time.UnixMicro(base).Add(24 * time.Hour)
	var (
		pruneDone atomic.Bool
		pruneErr  error
		pruneEl   time.Duration
	)
	go func() {
		time.Sleep(time.Second) // the workers first run at full speed
		t0 := time.Now()
		out.PruneRows, pruneErr = store.Prune(ctx, cutoff)
		pruneEl = time.Since(t0)
		pruneDone.Store(true)
	}()
	var during []float64
	_, _, err = scaleLoadTimed(ctx, store, res.Workers, func(time.Duration) bool { return pruneDone.Load() }, func(at, ms float64) {
		if at >= 1 {
			during = append(during, ms)
		}
	})
	if err != nil {
		return out, err
	}
	if pruneErr != nil {
		return out, fmt.Errorf("prune: %w", pruneErr)
	}
	out.PruneSeconds = pruneEl.Seconds()
	out.PruneOps = len(during)
	out.PruneP50MS, out.PruneP99MS = percentile(during, 50), percentile(during, 99)
	// A partitioned table's prune reports the dropped partition's rows as
	// the database estimates them (its statistics), not counted.
	want := int64(n / scaleDays)
	if out.PruneRows < want/2 || out.PruneRows > want*3/2 {
		return out, fmt.Errorf("prune of a day removed %d rows, want about %d", out.PruneRows, want)
	}
	// Let the pool's connections end, so that PostgreSQL's backends report
	// their statistics.
	db.SetMaxIdleConns(0)
	db.SetMaxIdleConns(res.Workers + 2)
	time.Sleep(1500 * time.Millisecond)
	if out.Dead, err = scaleDead(ctx, db, d, table); err != nil {
		return out, err
	}
	if err := scaleAnalyze(ctx, db, d, table); err != nil {
		return out, err
	}
	if out.TableMBAfter, out.IndexMBAfter, err = scaleSize(ctx, db, d, table); err != nil {
		return out, err
	}
	fmt.Fprintf(log, "%s %s %d: prune of %d rows in %.2fs; claim+confirm during it (%d) p50 %.2f ms, p99 %.2f ms; dead %d (before %d); table %.0f MB, indexes %.0f MB after\n",
		name, layout.name, n, out.PruneRows, out.PruneSeconds, out.PruneOps, out.PruneP50MS, out.PruneP99MS, out.Dead, out.DeadBefore, out.TableMBAfter, out.IndexMBAfter)
	return out, nil
}

// scaleFillMariaDB fills a MariaDB table with the keys 1..n in the order
// of the keys, a sixteenth of them (by the first hex digit of the key) per
// statement, and builds the updated_at index afterwards: InnoDB's clustered
// index then grows at its end, and the secondary index is built by a sort.
// Inserted in the order of their numbers, random keys into a table larger
// than the buffer pool (128 MB by default) read a page from disk per row:
// the plain table's fill slowed to ten minutes a million past six million.
func scaleFillMariaDB(ctx context.Context, db *sql.DB, table string, schema []string, partitioned bool, n int, base, step int64) error {
	m := regexp.MustCompile("INDEX `([^`]+)` \\(updated_at\\)").FindStringSubmatch(strings.Join(schema, "\n"))
	if m == nil {
		return errors.New("no updated_at index in the schema")
	}
	if _, err := db.ExecContext(ctx, "ALTER TABLE `"+table+"` DROP INDEX `"+m[1]+"`"); err != nil {
		return err
	}
	until, t := "", ""
	if partitioned {
		until, t = ", until_at", ", t"
	}
	for _, digit := range "0123456789abcdef" {
		q := "INSERT INTO `" + table + "` (`key`, state, token, attempts, expires_at, updated_at, first_at" + until + ")\n" +
			"SELECT k, 2, '', 1, 0, t, 0" + t + "\n" +
			"FROM (SELECT MD5(seq) AS k, " + strconv.FormatInt(base, 10) + " + (seq - 1) * " + strconv.FormatInt(step, 10) + " AS t\n" +
			"FROM seq_1_to_" + strconv.Itoa(n) + ") AS f WHERE k LIKE '" + string(digit) + "%' ORDER BY k"
		if _, err := db.ExecContext(ctx, q); err != nil {
			return err
		}
	}
	_, err := db.ExecContext(ctx, "ALTER TABLE `"+table+"` ADD INDEX `"+m[1]+"` (updated_at)")
	return err
}

// scaleFill inserts the confirmed keys lo..hi in one statement (PostgreSQL). A
// partitioned table's until_at is a confirmed key's updated_at.
func scaleFill(ctx context.Context, db *sql.DB, d sqldb.Dialect, table string, partitioned bool, lo, hi int, base, step int64) error {
	var q string
	until, t := "", ""
	if partitioned {
		until, t = ", until_at", ", t"
	}
	switch d {
	case sqldb.Postgres:
		q = `INSERT INTO "` + table + `" (key, state, token, attempts, expires_at, updated_at, first_at` + until + `)
SELECT convert_to(md5(g::text), 'UTF8'), 2, '', 1, 0, t, 0` + t + `
FROM (SELECT g, ` + strconv.FormatInt(base, 10) + ` + (g - 1)::bigint * ` + strconv.FormatInt(step, 10) + ` AS t
FROM generate_series(` + strconv.Itoa(lo) + `, ` + strconv.Itoa(hi) + `) AS g) AS f`
	case sqldb.MySQL:
		// MariaDB's Sequence engine: seq_1_to_N is a table of 1..N.
		q = "INSERT INTO `" + table + "` (`key`, state, token, attempts, expires_at, updated_at, first_at" + until + ")\n" +
			"SELECT MD5(seq), 2, '', 1, 0, t, 0" + t + "\n" +
			"FROM (SELECT seq, " + strconv.FormatInt(base, 10) + " + (seq - 1) * " + strconv.FormatInt(step, 10) + " AS t\n" +
			"FROM seq_" + strconv.Itoa(lo) + "_to_" + strconv.Itoa(hi) + ") AS f"
	default:
		return fmt.Errorf("dialect %s", d)
	}
	_, err := db.ExecContext(ctx, q)
	return err
}

func scaleAnalyze(ctx context.Context, db *sql.DB, d sqldb.Dialect, table string) error {
	q := `VACUUM ANALYZE "` + table + `"`
	if d == sqldb.MySQL {
		q = "ANALYZE TABLE `" + table + "`"
	}
	_, err := db.ExecContext(ctx, q)
	return err
}

// scaleSize returns the table's and its indexes' size in MB (every
// partition's together).
func scaleSize(ctx context.Context, db *sql.DB, d sqldb.Dialect, table string) (tableMB, indexMB float64, err error) {
	var t, i int64
	switch d {
	case sqldb.Postgres:
		err = db.QueryRowContext(ctx, `SELECT COALESCE(SUM(pg_table_size(relid)), 0)::bigint, COALESCE(SUM(pg_indexes_size(relid)), 0)::bigint
FROM pg_partition_tree($1::regclass) WHERE isleaf`, `"`+table+`"`).Scan(&t, &i)
		if err == nil && t == 0 {
			err = db.QueryRowContext(ctx, `SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass)`, `"`+table+`"`).Scan(&t, &i)
		}
	default:
		err = db.QueryRowContext(ctx, `SELECT SUM(data_length), SUM(index_length) FROM information_schema.TABLES
WHERE table_schema = DATABASE() AND table_name = ?`, table).Scan(&t, &i)
	}
	return float64(t) / (1 << 20), float64(i) / (1 << 20), err
}

// scaleDead is the dead row versions a prune leaves: n_dead_tup of the
// table's partitions on PostgreSQL, InnoDB's history list length on MariaDB.
func scaleDead(ctx context.Context, db *sql.DB, d sqldb.Dialect, table string) (int64, error) {
	var n int64
	switch d {
	case sqldb.Postgres:
		err := db.QueryRowContext(ctx, `SELECT COALESCE(SUM(s.n_dead_tup), 0)::bigint FROM pg_stat_user_tables s
WHERE s.relid IN (SELECT relid FROM pg_partition_tree($1::regclass)) OR s.relid = $1::regclass`, `"`+table+`"`).Scan(&n)
		return n, err
	default:
		err := db.QueryRowContext(ctx, `SELECT count FROM information_schema.INNODB_METRICS WHERE name = 'trx_rseg_history_len'`).Scan(&n)
		if errors.Is(err, sql.ErrNoRows) {
			return 0, nil
		}
		return n, err
	}
}

// scaleLoad runs claim+confirm of fresh keys from workers goroutines until
// stop says so, and returns each pair's latency in ms and the time taken.
func scaleLoad(ctx context.Context, s dedupe.Store, workers int, stop func(el time.Duration) bool) ([]float64, time.Duration, error) {
	return scaleLoadTimed(ctx, s, workers, stop, nil)
}

// scaleLoadTimed is scaleLoad that also reports each pair with the second
// of the run it started at.
func scaleLoadTimed(ctx context.Context, s dedupe.Store, workers int, stop func(el time.Duration) bool, each func(at, ms float64)) ([]float64, time.Duration, error) {
	var (
		mu   sync.Mutex
		lat  []float64
		wg   sync.WaitGroup
		errs = make(chan error, workers)
		next atomic.Int64
	)
	prefix := "scale-" + randomID() + "-"
	start := time.Now()
	for range workers {
		wg.Go(func() {
			var mine []float64
			var ats []float64
			for !stop(time.Since(start)) {
				key := prefix + strconv.FormatInt(next.Add(1), 10)
				t0 := time.Now()
				c, err := s.Claim(ctx, key, time.Minute)
				if err == nil && c.Result != dedupe.Acquired {
					err = fmt.Errorf("fresh key %s: %v", key, c.Result)
				}
				if err == nil {
					err = s.Confirm(ctx, c)
				}
				if err != nil {
					errs <- err
					return
				}
				mine = append(mine, float64(time.Since(t0).Microseconds())/1000)
				ats = append(ats, t0.Sub(start).Seconds())
			}
			mu.Lock()
			lat = append(lat, mine...)
			if each != nil {
				for i := range mine {
					each(ats[i], mine[i])
				}
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	el := time.Since(start)
	close(errs)
	for err := range errs {
		return nil, el, err
	}
	return lat, el, nil
}

func scaleTable(s *ScaleResults) string {
	if s == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Claim + confirm of fresh keys from %d goroutines for %.0f s on a table already holding the confirmed keys of %d days; then the prune of the oldest day while the goroutines go on:\n\n", s.Workers, s.Seconds, s.Days)
	b.WriteString("| database | table | keys | fill s | table MB | indexes MB | claim+confirm /s | p50 ms | p99 ms | p99 / p99 at smallest | prune: rows | prune s | p99 ms during prune | dead after (before) | table + indexes MB after |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	first := map[string]float64{}
	for _, r := range s.Runs {
		k := r.DB + "/" + r.Layout
		if _, ok := first[k]; !ok {
			first[k] = r.P99MS
		}
		dead := num(float64(r.Dead)) + " (" + num(float64(r.DeadBefore)) + ")"
		fmt.Fprintf(&b, "| %s | %s | %s | %.0f | %.0f | %.0f | %s | %.2f | %.2f | %.2f | %s | %.2f | %.2f | %s | %.0f |\n",
			r.DB, r.Layout, num(float64(r.Rows)), r.FillSeconds, r.TableMB, r.IndexMB, num(r.OpsPerSec), r.P50MS, r.P99MS,
			ratio(r.P99MS, first[k]), num(float64(r.PruneRows)), r.PruneSeconds, r.PruneP99MS, dead, r.TableMBAfter+r.IndexMBAfter)
	}
	b.WriteString("\nDead after: PostgreSQL's `n_dead_tup` of the table (its partitions'), MariaDB's InnoDB history list length (the whole server's, other work included).\n")
	return b.String()
}
