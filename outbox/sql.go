package outbox

import (
	"strconv"
	"strings"

	"github.com/settle-go/settle/dedupe"
)

// statements are the SQL of one outbox, built once by New from the dialect
// and the table names. Names are validated (Config.Topic) and quoted; values
// are always bound.
type statements struct {
	d        dedupe.Dialect
	table    string // unquoted outbox table name
	relays   string // unquoted relays table name
	qTable   string // quoted
	qRelays  string // quoted
	qPending string // quoted name of the index of pending rows

	schema []string

	// probe answers, in one cheap read, whether any row is pending.
	probe string
	// probeBeat is probe with the relay's heartbeat folded in (PostgreSQL
	// only: a data-modifying CTE). Args: relay id, seconds to live.
	probeBeat string
	// claim reads (and on PostgreSQL and SQLite marks) the next pending rows,
	// skipping those locked by another relay. Args: limit.
	claim string
	// claimMarks says whether claim already set forwarded_at.
	claimMarks bool

	status     string
	statusPass string // Args: offset of the oldest pending row.
	live       string
	beat       string // Args: relay id, seconds to live.
	forget     string // Args: relay id.
	sweep      string // deletes relay rows expired for an hour.
	prune      string // Args: seconds, limit.
	columns    string // Args: table name. One row per column name.
}

// outboxColumns and relayColumns are the columns Check requires.
var (
	outboxColumns = []string{"offset", "uuid", "topic", "payload", "metadata", "created_at", "forwarded_at"}
	relayColumns  = []string{"relay_id", "started_at", "expires_at"}
)

func quoteIdent(d dedupe.Dialect, name string) string {
	if d == dedupe.MySQL {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}

func newStatements(d dedupe.Dialect, topic string) statements {
	s := statements{d: d, table: topic, relays: topic + "_relays"}
	q := func(n string) string { return quoteIdent(d, n) }
	s.qTable, s.qRelays, s.qPending = q(s.table), q(s.relays), q(topic+"_pending")
	t, r := s.qTable, s.qRelays
	switch d {
	case dedupe.Postgres:
		s.schema = []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	"offset" BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	"uuid" TEXT NOT NULL,
	"topic" TEXT NOT NULL,
	"payload" BYTEA NOT NULL,
	"metadata" TEXT NOT NULL,
	"created_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
	"forwarded_at" TIMESTAMPTZ
)`,
			`CREATE INDEX IF NOT EXISTS ` + s.qPending + ` ON ` + t + ` ("offset") WHERE "forwarded_at" IS NULL`,
			`CREATE TABLE IF NOT EXISTS ` + r + ` (
	"relay_id" TEXT PRIMARY KEY,
	"started_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
	"expires_at" TIMESTAMPTZ NOT NULL
)`,
		}
		s.probe = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE "forwarded_at" IS NULL)`
		s.probeBeat = `WITH beat AS (INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES ($1, clock_timestamp() + make_interval(secs => $2))
	ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = EXCLUDED."expires_at")
SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE "forwarded_at" IS NULL)`
		s.claim = `UPDATE ` + t + ` SET "forwarded_at" = clock_timestamp() WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE "forwarded_at" IS NULL ORDER BY "offset" LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING "offset", "uuid", "topic", "payload", "metadata", EXTRACT(EPOCH FROM clock_timestamp() - "created_at")::float8`
		s.claimMarks = true
		s.status = `SELECT COUNT(*), COALESCE(MIN("offset"), 0), COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - MIN("created_at"))::float8, 0)
FROM ` + t + ` WHERE "forwarded_at" IS NULL`
		s.statusPass = `SELECT COUNT(*) FROM ` + t + ` WHERE "offset" > $1 AND "forwarded_at" IS NOT NULL
	AND "forwarded_at" > (SELECT "created_at" FROM ` + t + ` WHERE "offset" = $1)`
		s.live = `SELECT COUNT(*) FROM ` + r + ` WHERE "expires_at" > clock_timestamp()`
		s.beat = `INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES ($1, clock_timestamp() + make_interval(secs => $2))
ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = EXCLUDED."expires_at"`
		s.forget = `DELETE FROM ` + r + ` WHERE "relay_id" = $1`
		s.sweep = `DELETE FROM ` + r + ` WHERE "expires_at" < clock_timestamp() - INTERVAL '1 hour'`
		s.prune = `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE "forwarded_at" < clock_timestamp() - make_interval(secs => $1) LIMIT $2 FOR UPDATE SKIP LOCKED)`
		s.columns = `SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = $1`
	case dedupe.MySQL:
		s.schema = []string{
			"CREATE TABLE IF NOT EXISTS " + t + ` (
	` + "`offset`" + ` BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
	uuid TEXT NOT NULL,
	topic VARCHAR(255) NOT NULL,
	payload LONGBLOB NOT NULL,
	metadata LONGTEXT NOT NULL,
	created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
	forwarded_at TIMESTAMP(6) NULL DEFAULT NULL,
	KEY ` + s.qPending + " (forwarded_at, `offset`)\n)",
			"CREATE TABLE IF NOT EXISTS " + r + ` (
	relay_id VARCHAR(64) NOT NULL PRIMARY KEY,
	started_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
	expires_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
)`,
		}
		s.probe = "SELECT EXISTS (SELECT 1 FROM " + t + " WHERE forwarded_at IS NULL)"
		s.claim = "SELECT `offset`, uuid, topic, payload, metadata, TIMESTAMPDIFF(MICROSECOND, created_at, CURRENT_TIMESTAMP(6)) / 1000000.0 FROM " + t +
			" WHERE forwarded_at IS NULL ORDER BY `offset` LIMIT ? FOR UPDATE SKIP LOCKED"
		s.status = "SELECT COUNT(*), COALESCE(MIN(`offset`), 0), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), CURRENT_TIMESTAMP(6)) / 1000000.0, 0)\nFROM " +
			t + " WHERE forwarded_at IS NULL"
		s.statusPass = "SELECT COUNT(*) FROM " + t + " WHERE `offset` > ? AND forwarded_at IS NOT NULL\n\tAND forwarded_at > (SELECT created_at FROM " +
			t + " WHERE `offset` = ?)"
		s.live = "SELECT COUNT(*) FROM " + r + " WHERE expires_at > CURRENT_TIMESTAMP(6)"
		s.beat = "INSERT INTO " + r + " (relay_id, expires_at) VALUES (?, CURRENT_TIMESTAMP(6) + INTERVAL ? MICROSECOND)\n" +
			"ON DUPLICATE KEY UPDATE expires_at = VALUES(expires_at)"
		s.forget = "DELETE FROM " + r + " WHERE relay_id = ?"
		s.sweep = "DELETE FROM " + r + " WHERE expires_at < CURRENT_TIMESTAMP(6) - INTERVAL 1 HOUR"
		s.prune = "DELETE FROM " + t + " WHERE forwarded_at < CURRENT_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY forwarded_at LIMIT ?"
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
	"forwarded_at" TEXT
)`,
			`CREATE INDEX IF NOT EXISTS ` + s.qPending + ` ON ` + t + ` ("offset") WHERE "forwarded_at" IS NULL`,
			`CREATE TABLE IF NOT EXISTS ` + r + ` (
	"relay_id" TEXT PRIMARY KEY,
	"started_at" TEXT NOT NULL DEFAULT (` + now + `),
	"expires_at" TEXT NOT NULL
)`,
		}
		s.probe = `SELECT EXISTS (SELECT 1 FROM ` + t + ` WHERE "forwarded_at" IS NULL)`
		s.claim = `UPDATE ` + t + ` SET "forwarded_at" = ` + now + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE "forwarded_at" IS NULL ORDER BY "offset" LIMIT ?)
RETURNING "offset", "uuid", "topic", "payload", "metadata", (julianday('now') - julianday("created_at")) * 86400.0`
		s.claimMarks = true
		s.status = `SELECT COUNT(*), COALESCE(MIN("offset"), 0), COALESCE((julianday('now') - julianday(MIN("created_at"))) * 86400.0, 0)
FROM ` + t + ` WHERE "forwarded_at" IS NULL`
		s.statusPass = `SELECT COUNT(*) FROM ` + t + ` WHERE "offset" > ? AND "forwarded_at" IS NOT NULL
	AND "forwarded_at" > (SELECT "created_at" FROM ` + t + ` WHERE "offset" = ?)`
		s.live = `SELECT COUNT(*) FROM ` + r + ` WHERE "expires_at" > ` + now
		s.beat = `INSERT INTO ` + r + ` ("relay_id", "expires_at") VALUES (?, strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || ? || ' seconds'))
ON CONFLICT ("relay_id") DO UPDATE SET "expires_at" = excluded."expires_at"`
		s.forget = `DELETE FROM ` + r + ` WHERE "relay_id" = ?`
		s.sweep = `DELETE FROM ` + r + ` WHERE "expires_at" < strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hours')`
		s.prune = `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + ` WHERE "forwarded_at" < strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ? || ' seconds') LIMIT ?)`
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
	case dedupe.Postgres:
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
	case dedupe.MySQL:
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
	col := quoteIdent(s.d, "forwarded_at")
	off := quoteIdent(s.d, "offset")
	val := "NULL"
	if forwarded {
		switch s.d {
		case dedupe.Postgres:
			val = "clock_timestamp()"
		case dedupe.MySQL:
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
		if s.d == dedupe.Postgres {
			in.WriteString("$" + strconv.Itoa(i+1))
		} else {
			in.WriteString("?")
		}
	}
	return `UPDATE ` + s.qTable + ` SET ` + col + ` = ` + val + ` WHERE ` + off + ` IN (` + in.String() + `)`
}
