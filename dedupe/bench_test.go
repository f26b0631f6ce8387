package dedupe_test

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
)

// benchGoroutines are the concurrency levels of BenchmarkClaimConfirm. Each
// level runs exactly that many goroutines (see runConcurrent), whatever
// GOMAXPROCS is.
var benchGoroutines = []int{1, 4, 16}

// benchTTL is the claim lifetime; far longer than any op, so every claim of
// the benchmark takes the happy path (insert, then confirm).
const benchTTL = time.Minute

// benchKeyPrefix makes keys about as long as a message UUID (36 bytes).
const benchKeyPrefix = "bench-0000-0000-0000-"

// BenchmarkClaimConfirm measures one message's dedupe work: Claim of a key
// never seen before, then Confirm. For each SQL database the "floor"
// sub-benchmark runs the same number of statements on a table of the same
// shape without owner checks (INSERT … ON CONFLICT DO NOTHING or INSERT
// IGNORE, then a plain UPDATE by key), so settle/floor says what the store's
// statement shapes and bookkeeping cost over the least a claim table can do.
//
// Names: BenchmarkClaimConfirm/<store>/g=<goroutines>/<settle|floor>. The
// metric msgs/s is b.N over the elapsed time.
func BenchmarkClaimConfirm(b *testing.B) {
	b.Run("memory", func(b *testing.B) {
		for _, g := range benchGoroutines {
			b.Run("g="+strconv.Itoa(g), func(b *testing.B) {
				benchStore(b, g, dedupe.NewMemoryStore(), nil)
			})
		}
	})
	for _, d := range testenv.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			// open returns the database one sub-benchmark run works on.
			open := benchDB(b, d.Open)
			for _, g := range benchGoroutines {
				b.Run("g="+strconv.Itoa(g), func(b *testing.B) {
					b.Run("settle", func(b *testing.B) {
						db := open(b)
						table := testenv.DedupeTable(b, db)
						store, err := dedupe.NewSQLStore(db.Driver(), dedupe.SQLConfig{Table: table})
						if err != nil {
							b.Fatal(err)
						}
						benchStore(b, g, store, func() { checkConfirmed(b, db, table, b.N) })
					})
					b.Run("floor", func(b *testing.B) {
						benchFloor(b, g, open(b))
					})
				})
			}
		})
	}
}

// benchDB opens a server database once, with one pooled connection per
// goroutine kept open between ops (the default of 2 idle connections would make
// most ops at g=16 dial). SQLite instead gets a new file for every run, so
// that settle and floor each start from an empty file and WAL rather than
// inheriting the other's; its pool stays at the 4 connections sqlurl allows.
func benchDB(b *testing.B, openDB func(testing.TB) testenv.DB) func(*testing.B) testenv.DB {
	db := openDB(b)
	if db.Dialect == sqldb.SQLite {
		return func(b *testing.B) testenv.DB {
			db := openDB(b)
			db.SetMaxIdleConns(4)
			return db
		}
	}
	n := benchGoroutines[len(benchGoroutines)-1]
	db.SetMaxOpenConns(n)
	db.SetMaxIdleConns(n)
	return func(*testing.B) testenv.DB { return db }
}

// benchStore runs claim+confirm of fresh keys on store with g goroutines, then
// calls check (if any) with the timer stopped.
func benchStore(b *testing.B, g int, store dedupe.Store, check func()) {
	runConcurrent(b, g, func(ctx context.Context, key string) error {
		c, err := store.Claim(ctx, key, benchTTL)
		if err != nil {
			return err
		}
		if c.Result != dedupe.Acquired || c.Attempt != 1 {
			return errors.New("fresh key " + key + " not acquired: " + c.Result.String())
		}
		return store.Confirm(ctx, c)
	})
	if check != nil {
		check()
	}
	// Every key is now confirmed: a second claim of one must see Duplicate.
	c, err := store.Claim(b.Context(), benchKeyPrefix+"0", benchTTL)
	if err != nil {
		b.Fatal(err)
	}
	if c.Result != dedupe.Duplicate {
		b.Fatalf("claim of a confirmed key: got %v, want duplicate", c.Result)
	}
}

// benchFloor runs the raw-SQL floor: one insert-unless-present of the key and
// one UPDATE of that row per op, on a fresh table of the store's shape.
func benchFloor(b *testing.B, g int, db testenv.DB) {
	table := testenv.DedupeTable(b, db)
	var insert, update string
	switch db.Dialect {
	case sqldb.Postgres:
		insert = `INSERT INTO "` + table + `" (key, state, token, attempts, expires_at, updated_at) VALUES ($1, 1, $2, 1, $3, $4) ON CONFLICT DO NOTHING`
		update = `UPDATE "` + table + `" SET state = 2, token = '', expires_at = 0, updated_at = $1 WHERE key = $2`
	case sqldb.MySQL:
		insert = "INSERT IGNORE INTO `" + table + "` (`key`, state, token, attempts, expires_at, updated_at) VALUES (?, 1, ?, 1, ?, ?)"
		update = "UPDATE `" + table + "` SET state = 2, token = '', expires_at = 0, updated_at = ? WHERE `key` = ?"
	default:
		insert = `INSERT INTO "` + table + `" (key, state, token, attempts, expires_at, updated_at) VALUES (?, 1, ?, 1, ?, ?) ON CONFLICT DO NOTHING`
		update = `UPDATE "` + table + `" SET state = 2, token = '', expires_at = 0, updated_at = ? WHERE key = ?`
	}
	const token = "0123456789abcdef0123456789abcdef" // same width as a store token
	exec := db.ExecContext
	if db.Dialect == sqldb.MySQL {
		// As the store does on MySQL: the arguments written into the
		// statements, so that go-sql-driver/mysql sends each as one query,
		// not a prepare and an execute.
		exec = func(ctx context.Context, query string, args ...any) (sql.Result, error) {
			query, args = dedupe.InlineArgs(query, args)
			return db.ExecContext(ctx, query, args...)
		}
	}
	runConcurrent(b, g, func(ctx context.Context, key string) error {
		now := time.Now()
		k := []byte(key)
		if _, err := exec(ctx, insert, k, token, now.Add(benchTTL).UnixMicro(), now.UnixMicro()); err != nil {
			return err
		}
		_, err := exec(ctx, update, time.Now().UnixMicro(), k)
		return err
	})
	checkConfirmed(b, db, table, b.N)
}

// checkConfirmed fails b unless table holds exactly want rows, all confirmed.
func checkConfirmed(b *testing.B, db testenv.DB, table string, want int) {
	b.Helper()
	q := `SELECT COUNT(*), COALESCE(SUM(CASE WHEN state = 2 THEN 1 ELSE 0 END), 0) FROM "` + table + `"`
	if db.Dialect == sqldb.MySQL {
		q = "SELECT COUNT(*), COALESCE(SUM(CASE WHEN state = 2 THEN 1 ELSE 0 END), 0) FROM `" + table + "`"
	}
	var rows, confirmed int
	if err := db.QueryRowContext(b.Context(), q).Scan(&rows, &confirmed); err != nil {
		b.Fatal(err)
	}
	if rows != want || confirmed != want {
		b.Fatalf("%s: %d rows, %d confirmed; want %d of each", table, rows, confirmed, want)
	}
}

// runConcurrent calls op b.N times in total, each time with a fresh key, from
// exactly g goroutines that take ops from a shared counter (so a slow
// goroutine does not hold the others up at the end). It reports msgs/s.
func runConcurrent(b *testing.B, g int, op func(ctx context.Context, key string) error) {
	b.Helper()
	ctx := b.Context()
	var (
		next     atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
		failed   atomic.Bool
	)
	n := int64(b.N)
	b.ResetTimer()
	for range g {
		wg.Go(func() {
			for !failed.Load() {
				i := next.Add(1) - 1
				if i >= n {
					return
				}
				if err := op(ctx, benchKeyPrefix+strconv.FormatInt(i, 10)); err != nil {
					errOnce.Do(func() { firstErr = err })
					failed.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}
