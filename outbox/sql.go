package outbox

import (
	"strconv"
	"strings"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// statements are the SQL of one outbox, built once by New from the dialect
// and the table names. Names are validated (Config.Topic) and quoted; values
// are always bound.
type statements struct {
	d        sqldb.Dialect
	table    string // unquoted outbox table name
	relays   string // unquoted relays table name
	qTable   string // quoted
	qRelays  string // quoted
	qReady   string // quoted name of the index of rows to forward
	qAside   string // quoted name of the index of rows set aside
	qPending string // quoted name of the index of pending rows of earlier versions

	schema  []string
	upgrade []string // from the table of settle before per-row failures

	// probe answers, in one cheap read, whether any row is pending.
	probe string
	// probeBeat is probe with the relay's heartbeat folded in (PostgreSQL
	// only: a data-modifying CTE). Args: relay id, seconds to live.
	probeBeat string
	// claim reads (and on PostgreSQL and SQLite marks) the next rows to
	// forward, skipping those locked by another relay, those waiting for
	// their next attempt and those set aside, and stopping before the row
	// that would take the batch past its byte bound (the first row is
	// always taken). Args: limit, bytes. On MySQL it returns only offset,
	// size and attempts; fetch reads the rest. Otherwise it returns offset,
	// uuid, topic, payload, metadata, age in seconds, attempts.
	claim string
	// fetch (MySQL) reads the rows claim locked: offset, uuid, topic,
	// payload, metadata, age in seconds. Args: the offsets (see in).
	fetch string
	// claimMarks says whether claim already set forwarded_at.
	claimMarks bool
	// fail records a failed publish of one row: forwarded_at back to NULL,
	// attempts + 1, the error, the next attempt after a delay, or the row
	// set aside. Args: error text, delay in seconds (microseconds on
	// MySQL), set aside (0 or 1), offset.
	fail string

	status     string
	statusPass string // Args: offset of the oldest pending row.
	statusHead string // Args: offset of the oldest pending row. Attempts, last error, 1 if waiting for its next attempt.
	aside      string // count of rows set aside
	live       string
	beat       string // Args: relay id, seconds to live.
	forget     string // Args: relay id.
	sweep      string // deletes relay rows expired for an hour.
	prune      string // Args: seconds, limit.
	// pruneWhere is prune's filter, with its arguments but the limit: what
	// a prune deletes (the settle command's dry run counts it, see
	// prunesel.go).
	pruneWhere string
	columns    string // Args: table name. One row per column name.
}

// outboxColumns and relayColumns are the columns Check requires;
// failureColumns are those of outboxColumns that settle added when the relay
// learnt to retry and set aside rows one by one (the upgrade statements add
// them).
var (
	outboxColumns  = []string{"offset", "uuid", "topic", "payload", "metadata", "created_at", "forwarded_at", "attempts", "last_error", "next_attempt_at", "set_aside_at"}
	failureColumns = []string{"attempts", "last_error", "next_attempt_at", "set_aside_at"}
	relayColumns   = []string{"relay_id", "started_at", "expires_at"}
)

// The filters of a row to forward now, in each dialect.
const (
	pgReady     = `"forwarded_at" IS NULL AND "set_aside_at" IS NULL AND ("next_attempt_at" IS NULL OR "next_attempt_at" <= clock_timestamp())`
	myReady     = "forwarded_at IS NULL AND set_aside_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= CURRENT_TIMESTAMP(6))"
	sqliteNow   = `strftime('%Y-%m-%d %H:%M:%f', 'now')`
	sqliteReady = `"forwarded_at" IS NULL AND "set_aside_at" IS NULL AND ("next_attempt_at" IS NULL OR "next_attempt_at" <= ` + sqliteNow + `)`
)

// claimWindow wraps the locking read inner (offset and size of the next
// rows, in offset order) in the query of the offsets that fit the byte
// bound: the first row always, then rows while the running total stays
// within the bound (placeholder bytes).
func claimWindow(inner, bytes string) string {
	return `SELECT "offset" FROM (SELECT "offset", SUM("size") OVER (ORDER BY "offset") AS "total", ROW_NUMBER() OVER (ORDER BY "offset") AS "n"
		FROM (` + inner + `) AS "l") AS "s" WHERE "n" = 1 OR "total" <= ` + bytes
}

func newStatements(d sqldb.Dialect, topic string) statements {
	s := statements{d: d, table: topic, relays: topic + "_relays"}
	q := func(n string) string { return sqlkit.Quote(d, n) }
	s.qTable, s.qRelays, s.qPending = q(s.table), q(s.relays), q(topic+"_pending")
	s.qReady, s.qAside = q(topic+"_ready"), q(topic+"_set_aside")
	t, r := s.qTable, s.qRelays
	switch d {
	case sqldb.Postgres:
		s.schema = []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	"offset" BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	"uuid" TEXT NOT NULL,
	"topic" TEXT NOT NULL,
	"payload" BYTEA NOT NULL,
	"metadata" TEXT NOT NULL,
	"created_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
	"forwarded_at" TIMESTAMPTZ,
	"attempts" INTEGER NOT NULL DEFAULT 0,
	"last_error" TEXT,
	"next_attempt_at" TIMESTAMPTZ,
	"set_aside_at" TIMESTAMPTZ
)`,
			`CREATE INDEX IF NOT EXISTS ` + s.qReady + ` ON ` + t + ` ("offset") WHERE "forwarded_at" IS NULL AND "set_aside_at" IS NULL`,
			`CREATE INDEX IF NOT EXISTS ` + s.qAside + ` ON ` + t + ` ("offset") WHERE "set_aside_at" IS NOT NULL`,
			`CREATE TABLE IF NOT EXISTS ` + r + ` (
	"relay_id" TEXT PRIMARY KEY,
	"started_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
	"expires_at" TIMESTAMPTZ NOT NULL
)`,
		}
		s.upgrade = []string{
			`ALTER TABLE ` + t + ` ADD COLUMN IF NOT EXISTS "attempts" INTEGER NOT NULL DEFAULT 0,
	ADD COLUMN IF NOT EXISTS "last_error" TEXT,
	ADD COLUMN IF NOT EXISTS "next_attempt_at" TIMESTAMPTZ,
	ADD COLUMN IF NOT EXISTS "set_aside_at" TIMESTAMPTZ`,
			s.schema[1],
			s.schema[2],
			`DROP INDEX IF EXISTS ` + s.qPending,
		}
		s.probe = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE ` + pgReady + `)`
		s.probeBeat = `WITH beat AS (INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES ($1, clock_timestamp() + make_interval(secs => $2))
	ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = EXCLUDED."expires_at")
` + s.probe
		s.claim = `UPDATE ` + t + ` SET "forwarded_at" = clock_timestamp() WHERE "offset" IN (
	` + claimWindow(`SELECT "offset", octet_length("payload") + octet_length("metadata") AS "size" FROM `+t+` WHERE `+pgReady+`
		ORDER BY "offset" LIMIT $1 FOR UPDATE SKIP LOCKED`, "$2") + `)
RETURNING "offset", "uuid", "topic", "payload", "metadata", EXTRACT(EPOCH FROM clock_timestamp() - "created_at")::float8, "attempts"`
		s.claimMarks = true
		s.fail = `UPDATE ` + t + ` SET "forwarded_at" = NULL, "attempts" = "attempts" + 1, "last_error" = $1,
	"next_attempt_at" = CASE WHEN $3 = 1 THEN NULL ELSE clock_timestamp() + make_interval(secs => $2) END,
	"set_aside_at" = CASE WHEN $3 = 1 THEN clock_timestamp() ELSE NULL END
WHERE "offset" = $4`
		s.status = `SELECT COUNT(*), COALESCE(MIN("offset"), 0), COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - MIN("created_at"))::float8, 0),
	COALESCE(SUM(CASE WHEN "attempts" > 0 THEN 1 ELSE 0 END), 0)
FROM ` + t + ` WHERE "forwarded_at" IS NULL AND "set_aside_at" IS NULL`
		s.statusHead = `SELECT "attempts", COALESCE("last_error", ''), CASE WHEN "next_attempt_at" > clock_timestamp() THEN 1 ELSE 0 END FROM ` + t + ` WHERE "offset" = $1`
		s.aside = `SELECT COUNT(*) FROM ` + t + ` WHERE "set_aside_at" IS NOT NULL`
		s.statusPass = `SELECT COUNT(*) FROM ` + t + ` WHERE "offset" > $1 AND "forwarded_at" IS NOT NULL
	AND "forwarded_at" > (SELECT "created_at" FROM ` + t + ` WHERE "offset" = $1)`
		s.live = `SELECT COUNT(*) FROM ` + r + ` WHERE "expires_at" > clock_timestamp()`
		s.beat = `INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES ($1, clock_timestamp() + make_interval(secs => $2))
ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = EXCLUDED."expires_at"`
		s.forget = `DELETE FROM ` + r + ` WHERE "relay_id" = $1`
		s.sweep = `DELETE FROM ` + r + ` WHERE "expires_at" < clock_timestamp() - INTERVAL '1 hour'`
		s.pruneWhere = `"forwarded_at" < clock_timestamp() - make_interval(secs => $1)`
		s.prune = `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE ` + s.pruneWhere + ` LIMIT $2 FOR UPDATE SKIP LOCKED)`
		s.columns = `SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = $1`
	case sqldb.MySQL:
		s.schema = []string{
			"CREATE TABLE IF NOT EXISTS " + t + ` (
	` + "`offset`" + ` BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
	uuid TEXT NOT NULL,
	topic VARCHAR(255) NOT NULL,
	payload LONGBLOB NOT NULL,
	metadata LONGTEXT NOT NULL,
	created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
	forwarded_at TIMESTAMP(6) NULL DEFAULT NULL,
	attempts INT NOT NULL DEFAULT 0,
	last_error TEXT NULL,
	next_attempt_at TIMESTAMP(6) NULL DEFAULT NULL,
	set_aside_at TIMESTAMP(6) NULL DEFAULT NULL,
	KEY ` + s.qReady + " (forwarded_at, set_aside_at, `offset`),\n\tKEY " + s.qAside + " (set_aside_at)\n)",
			"CREATE TABLE IF NOT EXISTS " + r + ` (
	relay_id VARCHAR(64) NOT NULL PRIMARY KEY,
	started_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
	expires_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
)`,
		}
		s.upgrade = []string{
			"ALTER TABLE " + t + " ADD COLUMN attempts INT NOT NULL DEFAULT 0,\n\tADD COLUMN last_error TEXT NULL,\n" +
				"\tADD COLUMN next_attempt_at TIMESTAMP(6) NULL DEFAULT NULL,\n\tADD COLUMN set_aside_at TIMESTAMP(6) NULL DEFAULT NULL,\n" +
				"\tADD KEY " + s.qReady + " (forwarded_at, set_aside_at, `offset`),\n\tADD KEY " + s.qAside + " (set_aside_at),\n\tDROP KEY " + s.qPending,
		}
		s.probe = "SELECT EXISTS (SELECT 1 FROM " + t + " WHERE " + myReady + ")"
		// No window here: MySQL would read (and lock) every pending row
		// to compute it. The relay cuts the batch at the byte bound.
		s.claim = "SELECT `offset`, LENGTH(payload) + LENGTH(metadata), attempts FROM " + t +
			" WHERE " + myReady + " ORDER BY `offset` LIMIT ? FOR UPDATE SKIP LOCKED"
		s.fetch = "SELECT `offset`, uuid, topic, payload, metadata, TIMESTAMPDIFF(MICROSECOND, created_at, CURRENT_TIMESTAMP(6)) / 1000000.0 FROM " + t +
			" WHERE `offset` IN "
		s.fail = "UPDATE " + t + " SET forwarded_at = NULL, attempts = attempts + 1, last_error = ?,\n" +
			"\tnext_attempt_at = CASE WHEN ? = 1 THEN NULL ELSE CURRENT_TIMESTAMP(6) + INTERVAL ? MICROSECOND END,\n" +
			"\tset_aside_at = CASE WHEN ? = 1 THEN CURRENT_TIMESTAMP(6) ELSE NULL END\nWHERE `offset` = ?"
		s.status = "SELECT COUNT(*), COALESCE(MIN(`offset`), 0), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), CURRENT_TIMESTAMP(6)) / 1000000.0, 0),\n" +
			"\tCOALESCE(SUM(CASE WHEN attempts > 0 THEN 1 ELSE 0 END), 0)\nFROM " +
			t + " WHERE forwarded_at IS NULL AND set_aside_at IS NULL"
		s.statusHead = "SELECT attempts, COALESCE(last_error, ''), CASE WHEN next_attempt_at > CURRENT_TIMESTAMP(6) THEN 1 ELSE 0 END FROM " + t + " WHERE `offset` = ?"
		s.aside = "SELECT COUNT(*) FROM " + t + " WHERE set_aside_at IS NOT NULL"
		s.statusPass = "SELECT COUNT(*) FROM " + t + " WHERE `offset` > ? AND forwarded_at IS NOT NULL\n\tAND forwarded_at > (SELECT created_at FROM " +
			t + " WHERE `offset` = ?)"
		s.live = "SELECT COUNT(*) FROM " + r + " WHERE expires_at > CURRENT_TIMESTAMP(6)"
		s.beat = "INSERT INTO " + r + " (relay_id, expires_at) VALUES (?, CURRENT_TIMESTAMP(6) + INTERVAL ? MICROSECOND)\n" +
			"ON DUPLICATE KEY UPDATE expires_at = VALUES(expires_at)"
		s.forget = "DELETE FROM " + r + " WHERE relay_id = ?"
		s.sweep = "DELETE FROM " + r + " WHERE expires_at < CURRENT_TIMESTAMP(6) - INTERVAL 1 HOUR"
		s.pruneWhere = "forwarded_at < CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
		s.prune = "DELETE FROM " + t + " WHERE " + s.pruneWhere + " ORDER BY forwarded_at LIMIT ?"
		s.columns = "SELECT column_name FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = ?"
	default:
		now := `strftime('%Y-%m-%d %H:%M:%f', 'now')`
		s.schema = []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	"offset" INTEGER PRIMARY KEY AUTOINCREMENT,
	"uuid" TEXT NOT NULL,
	"topic" TEXT NOT NULL,
	"payload" BLOB NOT NULL,
	"metadata" TEXT NOT NULL,
	"created_at" TEXT NOT NULL DEFAULT (` + now + `),
	"forwarded_at" TEXT,
	"attempts" INTEGER NOT NULL DEFAULT 0,
	"last_error" TEXT,
	"next_attempt_at" TEXT,
	"set_aside_at" TEXT
)`,
			`CREATE INDEX IF NOT EXISTS ` + s.qReady + ` ON ` + t + ` ("offset") WHERE "forwarded_at" IS NULL AND "set_aside_at" IS NULL`,
			`CREATE INDEX IF NOT EXISTS ` + s.qAside + ` ON ` + t + ` ("offset") WHERE "set_aside_at" IS NOT NULL`,
			`CREATE TABLE IF NOT EXISTS ` + r + ` (
	"relay_id" TEXT PRIMARY KEY,
	"started_at" TEXT NOT NULL DEFAULT (` + now + `),
	"expires_at" TEXT NOT NULL
)`,
		}
		s.upgrade = []string{
			`ALTER TABLE ` + t + ` ADD COLUMN "attempts" INTEGER NOT NULL DEFAULT 0`,
			`ALTER TABLE ` + t + ` ADD COLUMN "last_error" TEXT`,
			`ALTER TABLE ` + t + ` ADD COLUMN "next_attempt_at" TEXT`,
			`ALTER TABLE ` + t + ` ADD COLUMN "set_aside_at" TEXT`,
			s.schema[1],
			s.schema[2],
			`DROP INDEX IF EXISTS ` + s.qPending,
		}
		s.probe = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE ` + sqliteReady + `)`
		s.claim = `UPDATE ` + t + ` SET "forwarded_at" = ` + now + ` WHERE "offset" IN (
	` + claimWindow(`SELECT "offset", length("payload") + length(CAST("metadata" AS BLOB)) AS "size" FROM `+t+` WHERE `+sqliteReady+`
		ORDER BY "offset" LIMIT ?`, "?") + `)
RETURNING "offset", "uuid", "topic", "payload", "metadata", (julianday('now') - julianday("created_at")) * 86400.0, "attempts"`
		s.claimMarks = true
		s.fail = `UPDATE ` + t + ` SET "forwarded_at" = NULL, "attempts" = "attempts" + 1, "last_error" = ?1,
	"next_attempt_at" = CASE WHEN ?3 = 1 THEN NULL ELSE strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || ?2 || ' seconds') END,
	"set_aside_at" = CASE WHEN ?3 = 1 THEN ` + now + ` ELSE NULL END
WHERE "offset" = ?4`
		s.status = `SELECT COUNT(*), COALESCE(MIN("offset"), 0), COALESCE((julianday('now') - julianday(MIN("created_at"))) * 86400.0, 0),
	COALESCE(SUM(CASE WHEN "attempts" > 0 THEN 1 ELSE 0 END), 0)
FROM ` + t + ` WHERE "forwarded_at" IS NULL AND "set_aside_at" IS NULL`
		s.statusHead = `SELECT "attempts", COALESCE("last_error", ''), CASE WHEN "next_attempt_at" > ` + now + ` THEN 1 ELSE 0 END FROM ` + t + ` WHERE "offset" = ?`
		s.aside = `SELECT COUNT(*) FROM ` + t + ` WHERE "set_aside_at" IS NOT NULL`
		s.statusPass = `SELECT COUNT(*) FROM ` + t + ` WHERE "offset" > ? AND "forwarded_at" IS NOT NULL
	AND "forwarded_at" > (SELECT "created_at" FROM ` + t + ` WHERE "offset" = ?)`
		s.live = `SELECT COUNT(*) FROM ` + r + ` WHERE "expires_at" > ` + now
		s.beat = `INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES (?, strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || ? || ' seconds'))
ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = excluded."expires_at"`
		s.forget = `DELETE FROM ` + r + ` WHERE "relay_id" = ?`
		s.sweep = `DELETE FROM ` + r + ` WHERE "expires_at" < strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hours')`
		s.pruneWhere = `"forwarded_at" < strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ? || ' seconds')`
		s.prune = `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE ` + s.pruneWhere + ` LIMIT ?)`
		s.columns = `SELECT name FROM pragma_table_info(?)`
	}
	return s
}

// insert returns the INSERT of n messages, 4 arguments each. With notify
// (PostgreSQL only) the statement also queues a notification on the
// outbox's channel (one more argument), delivered by the server only if the
// transaction commits.
func (s statements) insert(n int, notify bool) string {
	var b strings.Builder
	b.WriteString(`INSERT INTO ` + s.qTable)
	switch s.d {
	case sqldb.Postgres:
		b.WriteString(` ("uuid", "topic", "payload", "metadata") SELECT v.u, v.t, v.p, v.m FROM (VALUES `)
		for i := range n {
			if i > 0 {
				b.WriteString(", ")
			}
			k := 4*i + 1
			b.WriteString("($" + strconv.Itoa(k) + "::text, $" + strconv.Itoa(k+1) + "::text, $" + strconv.Itoa(k+2) + "::bytea, $" + strconv.Itoa(k+3) + "::text)")
		}
		b.WriteString(`) AS v (u, t, p, m)`)
		if notify {
			b.WriteString(` CROSS JOIN (SELECT pg_notify($` + strconv.Itoa(4*n+1) + `, '')) AS n`)
		}
	case sqldb.MySQL:
		b.WriteString(" (uuid, topic, payload, metadata) VALUES ")
		b.WriteString(strings.TrimSuffix(strings.Repeat("(?, ?, ?, ?), ", n), ", "))
	default:
		b.WriteString(` ("uuid", "topic", "payload", "metadata") VALUES `)
		b.WriteString(strings.TrimSuffix(strings.Repeat("(?, ?, ?, ?), ", n), ", "))
	}
	return b.String()
}

// mark returns the statement that sets forwarded_at of n rows (value
// "now") or clears it (value "null"). Args: the rows' offsets.
func (s statements) mark(n int, forwarded bool) string {
	col := sqlkit.Quote(s.d, "forwarded_at")
	off := sqlkit.Quote(s.d, "offset")
	val := "NULL"
	if forwarded {
		switch s.d {
		case sqldb.Postgres:
			val = "clock_timestamp()"
		case sqldb.MySQL:
			val = "CURRENT_TIMESTAMP(6)"
		default:
			val = `strftime('%Y-%m-%d %H:%M:%f', 'now')`
		}
	}
	var in strings.Builder
	for i := range n {
		if i > 0 {
			in.WriteString(", ")
		}
		if s.d == sqldb.Postgres {
			in.WriteString("$" + strconv.Itoa(i+1))
		} else {
			in.WriteString("?")
		}
	}
	return `UPDATE ` + s.qTable + ` SET ` + col + ` = ` + val + ` WHERE ` + off + ` IN (` + in.String() + `)`
}
