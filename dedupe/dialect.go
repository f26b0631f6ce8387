package dedupe

import (
	"strings"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// state is the stored state of a key. Absent keys have no row; a released
// key keeps its row (and attempt count) but is treated as absent. A refused
// key (SQLStore.Refuse) is one whose message was dead-lettered without a
// run, by a delivery that had no attempt left and found the key not
// confirmed: every later claim of it, of any kind, is refused too.
type state int

const (
	stateReleased  state = 0
	stateClaimed   state = 1
	stateConfirmed state = 2
	stateRefused   state = 3
)

// indexName is the name of the updated_at index; schema-qualified tables get
// the index in the same schema, so only the table part is used.
func indexName(table string) string {
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		table = table[i+1:]
	}
	name := table + "_updated_at_idx"
	if len(name) > 63 {
		name = name[:63]
	}
	return name
}

// schema returns the DDL that creates the table and its index.
func schemaOf(d sqldb.Dialect, table string) []string {
	t := sqlkit.Quote(d, table)
	idx := indexName(table)
	switch d {
	case sqldb.Postgres:
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	key        BYTEA    NOT NULL PRIMARY KEY,
	state      SMALLINT NOT NULL,
	token      TEXT     NOT NULL,
	attempts   INTEGER  NOT NULL,
	expires_at BIGINT   NOT NULL,
	updated_at BIGINT   NOT NULL,
	first_at   BIGINT   NOT NULL DEFAULT 0
)`,
			`CREATE INDEX IF NOT EXISTS "` + idx + `" ON ` + t + ` (updated_at)`,
		}
	case sqldb.MySQL:
		return []string{
			"CREATE TABLE IF NOT EXISTS " + t + ` (
	` + "`key`" + `      VARBINARY(2048) NOT NULL PRIMARY KEY,
	state      TINYINT         NOT NULL,
	token      VARCHAR(32)     NOT NULL,
	attempts   INT             NOT NULL,
	expires_at BIGINT          NOT NULL,
	updated_at BIGINT          NOT NULL,
	first_at   BIGINT          NOT NULL DEFAULT 0,
	INDEX ` + "`" + idx + "`" + ` (updated_at)
) ENGINE=InnoDB`,
		}
	default: // SQLite
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	key        BLOB    NOT NULL PRIMARY KEY,
	state      INTEGER NOT NULL,
	token      TEXT    NOT NULL,
	attempts   INTEGER NOT NULL,
	expires_at INTEGER NOT NULL,
	updated_at INTEGER NOT NULL,
	first_at   INTEGER NOT NULL DEFAULT 0
)`,
			`CREATE INDEX IF NOT EXISTS "` + idx + `" ON ` + t + ` (updated_at)`,
		}
	}
}

// queries holds the statements of one dialect for one table, built once.
//
// PostgreSQL and MySQL/MariaDB read the time from the database's clock (the
// now expression below), so the workers sharing a table need not agree on
// the time. SQLite is one file on one machine: its statements take the time
// from the caller, the clock of that machine.
type queries struct {
	// claim inserts a new claimed row or takes over a released or expired
	// one. Args: key, token, ttl in µs (SQLite: key, token, expires_at, now).
	// On PostgreSQL and SQLite it returns the row it wrote (attempts,
	// expires_at) and nothing when it wrote none; MySQL has no RETURNING, so
	// the row is read back with readBack.
	claim string
	// claimLease (PostgreSQL only) is claim whose implicit transaction
	// commits without waiting for the WAL flush: set_config(…, true) in
	// its RETURNING sets synchronous_commit for that transaction alone,
	// before its commit reads it (see Config.ConfirmInTx). It returns one
	// more column, the setting's value. A statement that takes no key
	// returns no row, sets nothing, and has nothing to flush.
	claimLease string
	// insert (SQLite only) inserts a new claimed row unless the key exists;
	// takeover then takes over a released or expired row. On the happy path
	// this is one plain insert, which SQLite parses, plans and runs (holding
	// the write lock) faster than the upsert. Args: see claim; takeover:
	// token, expires_at, now, key.
	insert   string
	takeover string
	// claimDone inserts a confirmed row, or confirms a released or expired
	// one, for ClaimConfirmed. Args: key, token (SQLite: key, token, now).
	// Returns attempts where the dialect can.
	claimDone string
	// readBack reads a key's row as it is now, with the database's clock:
	// state, token, attempts, expires_at, first_at, now. Args: key. On MySQL it is a
	// locking read, so that inside a transaction it sees the latest
	// committed row rather than the transaction's snapshot.
	readBack string
	renew    string // args: ttl in µs (SQLite: expires_at), key, token
	confirm  string // args: key, token (SQLite: now, key, token)
	release  string // args: key, token (SQLite: now, key, token)
	// refuse turns a key that the caller's transaction wrote as confirmed
	// (ClaimConfirmed) into a refused one (Refuse). Args: key (SQLite:
	// now, key).
	refuse string
	// owner (MySQL only) tells whether token still holds the key, after
	// an UPDATE that reported no row: one row if it does. Args: key,
	// token. A locking read, so that it sees what the UPDATE saw.
	owner string
	// prune deletes at most a batch of rows that are confirmed or released
	// and older than the cutoff, or claims that expired before both the
	// cutoff and now. Args: cutoff, limit (SQLite: cutoff, min(cutoff, now),
	// limit).
	prune string
	// pruneWhere is prune's filter, with the arguments of prune but the
	// limit: what a prune deletes (the settle command's dry run counts it,
	// see prunesel.go).
	pruneWhere string

	// claimReturning and claimDoneReturning are claim and claimDone with
	// the row as the statement left it (readBack's columns) returned, for a
	// MySQL-dialect server that takes INSERT … RETURNING (MariaDB 10.5 and
	// later): the claim in one round trip instead of two.
	claimReturning, claimDoneReturning string

	// claimDoneLimited and confirmLimited (PostgreSQL only) are claimDone
	// and confirm that also set a transactional handler's server-side
	// limits for the rest of its transaction (sqlkit.TxHints; args: those
	// of claimDone and confirm, then the lock and idle timeouts in ms),
	// before they lock the key's row: the SET LOCAL they replace was a
	// round trip of its own. confirmLimited returns the transaction's
	// isolation level (one row: the claim is still the caller's).
	claimDoneLimited, confirmLimited string
	// confirmLevel is confirm returning the transaction's isolation level,
	// without the limits.
	confirmLevel string

	// partProbe, partInsert and partTakeover are the claim's statements on
	// a partitioned table (partition.go): the key's row in any partition,
	// locked, with readBack's columns and until_at; the insert of a new
	// claim (args: key, token, ttl in µs; MySQL: key, token, ttl, ttl),
	// returning expires_at and first_at on PostgreSQL; the takeover of the row found
	// (args: token, expires_at, now, key, its until_at).
	partProbe, partInsert, partTakeover string
}

// nowMicros is the database's clock in Unix microseconds, one value per
// statement (statement_timestamp, NOW(6)), so that a statement that reads it
// twice compares with the time it writes.
func nowMicros(d sqldb.Dialect) string {
	switch d {
	case sqldb.Postgres:
		return `(extract(epoch from statement_timestamp()) * 1000000)::bigint`
	case sqldb.MySQL:
		return mysqlNowMicros
	}
	return ""
}

// mysqlNowMicros is the MySQL/MariaDB clock in microseconds.
const mysqlNowMicros = `CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)`

func queriesOf(d sqldb.Dialect, table string) queries {
	t := sqlkit.Quote(d, table)
	now := nowMicros(d)
	var q queries
	switch d {
	case sqldb.Postgres:
		q.claim = `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at, first_at)
VALUES ($1, 1, $2, 1, ` + now + ` + $3, ` + now + `, ` + now + `)
ON CONFLICT (key) DO UPDATE SET state = 1, token = excluded.token, attempts = cur.attempts + 1,
	expires_at = excluded.expires_at, updated_at = excluded.updated_at,
	first_at = CASE WHEN cur.first_at = 0 THEN excluded.first_at ELSE cur.first_at END
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts, expires_at, first_at`
		q.claimLease = q.claim + `, set_config('synchronous_commit', 'off', true)`
		q.claimDone = `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
VALUES ($1, 2, $2, 1, 0, ` + now + `)
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts`
		q.claimDoneLimited = `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
SELECT $1, 2, $2, 1, 0, ` + now + ` WHERE ` + sqlkit.PostgresLimitsGate(3) + `
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts`
		q.readBack = `SELECT state, token, attempts, expires_at, first_at, ` + now + ` FROM ` + t + ` WHERE key = $1`
		q.renew = `UPDATE ` + t + ` SET expires_at = ` + now + ` + $1 WHERE key = $2 AND state = 1 AND token = $3`
		q.confirm = `UPDATE ` + t + ` SET state = 2, token = '', expires_at = 0, updated_at = ` + now + ` WHERE key = $1 AND state = 1 AND token = $2`
		q.confirmLevel, q.confirmLimited = confirmLevelQueries(q.confirm)
		q.release = `UPDATE ` + t + ` SET state = 0, token = '', expires_at = 0, updated_at = ` + now + ` WHERE key = $1 AND state = 1 AND token = $2`
		q.refuse = `UPDATE ` + t + ` SET state = 3, token = '', expires_at = 0, updated_at = ` + now + ` WHERE key = $1 AND state = 2`
		// The filter is repeated outside the subquery: when a selected row is
		// changed by a concurrent claim before the DELETE reaches it, PostgreSQL
		// re-evaluates only the outer WHERE on the new row version, so without
		// it a freshly taken claim would be deleted under its holder. SKIP
		// LOCKED leaves rows that a transaction is changing right now to the
		// next prune.
		pruneCond := `updated_at < $1 AND (state <> 1 OR expires_at < LEAST($1, ` + now + `))`
		q.prune = `DELETE FROM ` + t + ` WHERE key IN (SELECT key FROM ` + t + ` WHERE ` + pruneCond +
			` LIMIT $2 FOR UPDATE SKIP LOCKED) AND ` + pruneCond
		q.pruneWhere = pruneCond
	case sqldb.SQLite:
		q.insert = `INSERT INTO ` + t + ` (key, state, token, attempts, expires_at, updated_at, first_at)
VALUES (?1, 1, ?2, 1, ?3, ?4, ?4) ON CONFLICT (key) DO NOTHING RETURNING attempts, first_at`
		q.takeover = `UPDATE ` + t + ` SET state = 1, token = ?1, attempts = attempts + 1, expires_at = ?2, updated_at = ?3,
	first_at = CASE WHEN first_at = 0 THEN ?3 ELSE first_at END
WHERE key = ?4 AND (state = 0 OR (state = 1 AND expires_at <= ?3))
RETURNING attempts, first_at`
		q.claimDone = `INSERT INTO ` + t + ` AS cur (key, state, token, attempts, expires_at, updated_at)
VALUES (?1, 2, ?2, 1, 0, ?3)
ON CONFLICT (key) DO UPDATE SET state = 2, token = excluded.token, attempts = cur.attempts + 1, expires_at = 0, updated_at = excluded.updated_at
WHERE cur.state = 0 OR (cur.state = 1 AND cur.expires_at <= excluded.updated_at)
RETURNING attempts`
		q.readBack = `SELECT state, token, attempts, expires_at, first_at, 0 FROM ` + t + ` WHERE key = ?`
		q.renew = `UPDATE ` + t + ` SET expires_at = ? WHERE key = ? AND state = 1 AND token = ?`
		q.confirm = `UPDATE ` + t + ` SET state = 2, token = '', expires_at = 0, updated_at = ? WHERE key = ? AND state = 1 AND token = ?`
		q.release = `UPDATE ` + t + ` SET state = 0, token = '', expires_at = 0, updated_at = ? WHERE key = ? AND state = 1 AND token = ?`
		q.refuse = `UPDATE ` + t + ` SET state = 3, token = '', expires_at = 0, updated_at = ? WHERE key = ? AND state = 2`
		// One writer at a time: the DELETE cannot race a claim, but the filter
		// is repeated outside anyway so the statement is safe on its own.
		pruneCond := `updated_at < ?1 AND (state <> 1 OR expires_at < ?2)`
		q.prune = `DELETE FROM ` + t + ` WHERE rowid IN (SELECT rowid FROM ` + t + ` WHERE ` + pruneCond +
			` LIMIT ?3) AND ` + pruneCond
		q.pruneWhere = pruneCond
	case sqldb.MySQL:
		// MySQL has no conditional ON DUPLICATE KEY UPDATE, so every column is
		// set to itself unless the row may be taken over. Assignments run left
		// to right and see earlier ones, so state and expires_at, which the
		// condition reads, are assigned last. NOW(6) is fixed for the
		// statement, so both reads of the clock agree.
		//
		// Whether the statement took the key is decided by reading the row
		// back (readBack) and comparing its token with ours, never from the
		// affected-row count, which the DSN option clientFoundRows changes.
		cond := "(state = 0 OR (state = 1 AND expires_at <= VALUES(updated_at)))"
		q.claim = "INSERT INTO " + t + " (`key`, state, token, attempts, expires_at, updated_at, first_at) VALUES (?, 1, ?, 1, " + now + " + ?, " + now + ", " + now + ")\n" +
			"ON DUPLICATE KEY UPDATE first_at = IF(first_at = 0, VALUES(first_at), first_at),\n" +
			"\tattempts = IF(" + cond + ", attempts + 1, attempts),\n" +
			"\ttoken = IF(" + cond + ", VALUES(token), token),\n" +
			"\tupdated_at = IF(" + cond + ", VALUES(updated_at), updated_at),\n" +
			"\tstate = IF(" + cond + ", 1, state),\n" +
			"\texpires_at = IF(state = 1 AND token = VALUES(token), VALUES(expires_at), expires_at)"
		q.claimDone = "INSERT INTO " + t + " (`key`, state, token, attempts, expires_at, updated_at) VALUES (?, 2, ?, 1, 0, " + now + ")\n" +
			"ON DUPLICATE KEY UPDATE attempts = IF(" + cond + ", attempts + 1, attempts),\n" +
			"\ttoken = IF(" + cond + ", VALUES(token), token),\n" +
			"\tupdated_at = IF(" + cond + ", VALUES(updated_at), updated_at),\n" +
			"\texpires_at = IF(" + cond + ", 0, expires_at),\n" +
			"\tstate = IF(" + cond + ", 2, state)"
		q.readBack = "SELECT state, token, attempts, expires_at, first_at, " + now + " FROM " + t + " WHERE `key` = ? FOR UPDATE"
		q.claimReturning = q.claim + "\nRETURNING " + mysqlReturnedRow
		q.claimDoneReturning = q.claimDone + "\nRETURNING " + mysqlReturnedRow
		q.renew = "UPDATE " + t + " SET expires_at = " + now + " + ? WHERE `key` = ? AND state = 1 AND token = ?"
		q.confirm = "UPDATE " + t + " SET state = 2, token = '', expires_at = 0, updated_at = " + now + " WHERE `key` = ? AND state = 1 AND token = ?"
		q.release = "UPDATE " + t + " SET state = 0, token = '', expires_at = 0, updated_at = " + now + " WHERE `key` = ? AND state = 1 AND token = ?"
		q.refuse = "UPDATE " + t + " SET state = 3, token = '', expires_at = 0, updated_at = " + now + " WHERE `key` = ? AND state = 2"
		// A locking read: inside a caller's transaction at REPEATABLE READ
		// (InnoDB's default) a plain SELECT reads the transaction's
		// snapshot, in which a claim taken over since is still the
		// caller's. FOR UPDATE reads the latest committed row, as the
		// UPDATE before it did, at every isolation level.
		q.owner = "SELECT 1 FROM " + t + " WHERE `key` = ? AND state = 1 AND token = ? FOR UPDATE"
		// A single DELETE with its filter and LIMIT: InnoDB evaluates the
		// filter on the latest row version under the row lock, so a claim
		// taken while the prune runs is never deleted.
		q.pruneWhere = "updated_at < ? AND (state <> 1 OR expires_at < LEAST(?, " + now + "))"
		q.prune = "DELETE FROM " + t + " WHERE " + q.pruneWhere + " LIMIT ?"
	}
	return q
}

// confirmLevelQueries are PostgreSQL's confirm returning the transaction's
// isolation level, and the same setting a pipeline transaction's limits
// first (queries.confirmLevel, queries.confirmLimited).
func confirmLevelQueries(confirm string) (level, limited string) {
	const returning = ` RETURNING current_setting('transaction_isolation')`
	return confirm + returning, confirm + ` AND ` + sqlkit.PostgresLimitsGate(3) + returning
}

// mysqlReturnedRow is what a MariaDB claim returns: readBack's columns, from
// the row as the statement left it (inserted, taken over, or untouched and
// locked). NOW(6) is fixed for the statement, so the clock agrees with the
// one the statement's condition read.
const mysqlReturnedRow = "state, token, attempts, expires_at, first_at, " + mysqlNowMicros
