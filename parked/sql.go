package parked

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// Bounds on the text columns, in characters, that every dialect's columns
// take (MySQL's VARCHARs; an index entry of (handler, last_failure, id)
// must fit in InnoDB's 3072 bytes and PostgreSQL's 2704). Longer values are
// cut.
const (
	maxName   = 600      // handler, topic
	maxBy     = 255      // replayed_by, archived_by
	maxTrace  = 64       // trace_id
	maxReason = 16 << 10 // reason, in bytes
)

// statements are the SQL of one store, built once by New from the dialect
// and the table names. Names are validated (Config.Table) and quoted;
// values are always bound.
//
// Times are BIGINT Unix microseconds (0: none), written from the clock of
// the process that changes the row, so that every dialect compares and
// orders them alike. Binary columns (ident, uuid, dedupe_key, payload) keep
// any bytes; metadata is internal/mdcolumn's text.
type statements struct {
	d             sqldb.Dialect
	table, groups string // unquoted
	t, g          string // quoted

	createRows, createGroups string
	schema                   []string

	// insert writes a new row unless one of the same ident exists. Args:
	// insertCols.
	insert string
	// find reads the row of an ident under its lock: id, state, group_id,
	// token, attempts, first_failure, last_failure. Args: ident.
	find string
	// refresh updates a parked row parked again. Args: outcome, reason,
	// group_id, attempts, first_failure, last_failure, trace_id,
	// updated_at, id.
	refresh string
	// groupAdd adds a group's counts, creating its row. Args: group_id,
	// handler, error_type, norm_text, outcome, parked delta, total delta,
	// first seen, last seen.
	groupAdd string
	// groupBump adds to a group's counts. Args: parked delta, total
	// delta, group_id.
	groupBump string
	// groupDrop deletes a group left with no row. Args: group_id.
	groupDrop string
	// takeLock is a write that changes nothing, the first statement of a
	// transaction on SQLite, so that it holds the database's write lock
	// from its start.
	takeLock string
	// lock is appended to a read that decides a write: " FOR UPDATE", or
	// "" on SQLite, whose transactions take the database's write lock
	// when they begin.
	lock string
	// skipLocked is lock for a delete's read: rows another transaction is
	// changing are left for the next prune.
	skipLocked string
}

// insertCols are the columns insert writes, in the order of its arguments.
var insertCols = []string{"ident", "handler", "topic", "uuid", "dedupe_key", "outcome", "reason", "group_id", "attempts",
	"first_failure", "last_failure", "trace_id", "payload", "metadata", "state", "replay_count", "replayed_at", "replayed_by",
	"archived_at", "archived_by", "token", "updated_at"}

// rowCols are the columns of a Message but payload and metadata, in the
// order scanRow reads them.
const rowCols = "id, handler, topic, uuid, dedupe_key, outcome, reason, group_id, attempts, first_failure, last_failure, trace_id, " +
	"state, replay_count, replayed_at, replayed_by, archived_at, archived_by"

// groupCols are the columns of a Group, in the order scanGroup reads them.
const groupCols = "group_id, handler, error_type, norm_text, outcome, parked, total, first_seen, last_seen"

// indexName is the name of the index suffix of table: the table's part
// after any schema, cut (with a hash to keep it unique) to 63 bytes.
func indexName(table, suffix string) string {
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		table = table[i+1:]
	}
	name := table + "_" + suffix
	if len(name) > 63 {
		sum := sha256.Sum256([]byte(name))
		name = table[:63-len(suffix)-10] + "_" + hex.EncodeToString(sum[:4]) + "_" + suffix
	}
	return name
}

func newStatements(d sqldb.Dialect, table string) statements {
	s := statements{d: d, table: table, groups: table + "_groups"}
	s.t, s.g = sqlkit.Quote(d, s.table), sqlkit.Quote(d, s.groups)
	t, g := s.t, s.g
	idx := func(suffix string) string { return sqlkit.Quote(d, indexName(table, suffix)) }
	gidx := func(suffix string) string { return sqlkit.Quote(d, indexName(s.groups, suffix)) }
	ph := make([]string, len(insertCols))
	for i := range ph {
		ph[i] = s.ph(i + 1)
	}
	cols, vals := strings.Join(insertCols, ", "), strings.Join(ph, ", ")
	s.lock, s.skipLocked = " FOR UPDATE", " FOR UPDATE SKIP LOCKED"

	switch d {
	case sqldb.Postgres, sqldb.SQLite:
		id, bin, text, big, integer := "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", "BYTEA", "TEXT", "BIGINT", "INTEGER"
		if d == sqldb.SQLite {
			id, bin, big = "INTEGER PRIMARY KEY AUTOINCREMENT", "BLOB", "INTEGER"
			s.lock, s.skipLocked = "", ""
		}
		s.createRows = `CREATE TABLE IF NOT EXISTS ` + t + ` (
	id            ` + id + `,
	ident         ` + bin + ` NOT NULL,
	handler       ` + text + ` NOT NULL,
	topic         ` + text + ` NOT NULL,
	uuid          ` + bin + ` NOT NULL,
	dedupe_key    ` + bin + ` NOT NULL,
	outcome       ` + text + ` NOT NULL,
	reason        ` + text + ` NOT NULL,
	group_id      ` + text + ` NOT NULL,
	attempts      ` + integer + ` NOT NULL,
	first_failure ` + big + ` NOT NULL,
	last_failure  ` + big + ` NOT NULL,
	trace_id      ` + text + ` NOT NULL,
	payload       ` + bin + ` NOT NULL,
	metadata      ` + text + ` NOT NULL,
	state         ` + text + ` NOT NULL,
	replay_count  ` + integer + ` NOT NULL,
	replayed_at   ` + big + ` NOT NULL,
	replayed_by   ` + text + ` NOT NULL,
	archived_at   ` + big + ` NOT NULL,
	archived_by   ` + text + ` NOT NULL,
	token         ` + text + ` NOT NULL,
	updated_at    ` + big + ` NOT NULL
)`
		s.createGroups = `CREATE TABLE IF NOT EXISTS ` + g + ` (
	group_id   ` + text + ` NOT NULL PRIMARY KEY,
	handler    ` + text + ` NOT NULL,
	error_type ` + text + ` NOT NULL,
	norm_text  ` + text + ` NOT NULL,
	outcome    ` + text + ` NOT NULL,
	parked     ` + big + ` NOT NULL,
	total      ` + big + ` NOT NULL,
	first_seen ` + big + ` NOT NULL,
	last_seen  ` + big + ` NOT NULL
)`
		s.schema = []string{
			s.createRows,
			`CREATE UNIQUE INDEX IF NOT EXISTS ` + idx("ident") + ` ON ` + t + ` (ident)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("recent") + ` ON ` + t + ` (last_failure, id)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("group") + ` ON ` + t + ` (group_id, last_failure, id)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("preview") + ` ON ` + t + ` (` + previewCols + `)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("handler") + ` ON ` + t + ` (handler, last_failure, id)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("topic") + ` ON ` + t + ` (topic, last_failure, id)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("state") + ` ON ` + t + ` (state, last_failure, id)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("changed") + ` ON ` + t + ` (state, updated_at)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("uuid") + ` ON ` + t + ` (` + s.prefix("uuid") + `)`,
			`CREATE INDEX IF NOT EXISTS ` + idx("key") + ` ON ` + t + ` (` + s.prefix("dedupe_key") + `)`,
			s.createGroups,
			`CREATE INDEX IF NOT EXISTS ` + gidx("seen") + ` ON ` + g + ` (last_seen)`,
			`CREATE INDEX IF NOT EXISTS ` + gidx("handler") + ` ON ` + g + ` (handler, last_seen)`,
		}
		s.insert = `INSERT INTO ` + t + ` (` + cols + `) VALUES (` + vals + `) ON CONFLICT (ident) DO NOTHING`
		least, greatest := "LEAST", "GREATEST"
		if d == sqldb.SQLite {
			least, greatest = "min", "max"
		}
		s.groupAdd = `INSERT INTO ` + g + ` (` + groupCols + `) VALUES (` + s.phs(9) + `)
ON CONFLICT (group_id) DO UPDATE SET parked = ` + g + `.parked + excluded.parked, total = ` + g + `.total + excluded.total,
	first_seen = ` + least + `(` + g + `.first_seen, excluded.first_seen), last_seen = ` + greatest + `(` + g + `.last_seen, excluded.last_seen)`
	case sqldb.MySQL:
		s.createRows = "CREATE TABLE IF NOT EXISTS " + t + ` (
	id            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
	ident         BINARY(32)   NOT NULL,
	handler       VARCHAR(600) NOT NULL,
	topic         VARCHAR(600) NOT NULL,
	uuid          LONGBLOB     NOT NULL,
	dedupe_key    LONGBLOB     NOT NULL,
	outcome       VARCHAR(32)  NOT NULL,
	reason        MEDIUMTEXT   NOT NULL,
	group_id      VARCHAR(32)  NOT NULL,
	attempts      INT          NOT NULL,
	first_failure BIGINT       NOT NULL,
	last_failure  BIGINT       NOT NULL,
	trace_id      VARCHAR(64)  NOT NULL,
	payload       LONGBLOB     NOT NULL,
	metadata      LONGTEXT     NOT NULL,
	state         VARCHAR(16)  NOT NULL,
	replay_count  INT          NOT NULL,
	replayed_at   BIGINT       NOT NULL,
	replayed_by   VARCHAR(255) NOT NULL,
	archived_at   BIGINT       NOT NULL,
	archived_by   VARCHAR(255) NOT NULL,
	token         VARCHAR(32)  NOT NULL,
	updated_at    BIGINT       NOT NULL,
	UNIQUE KEY ` + idx("ident") + ` (ident),
	KEY ` + idx("recent") + ` (last_failure, id),
	KEY ` + idx("group") + ` (group_id, last_failure, id),
	KEY ` + idx("preview") + ` (` + previewCols + `),
	KEY ` + idx("handler") + ` (handler, last_failure, id),
	KEY ` + idx("topic") + ` (topic, last_failure, id),
	KEY ` + idx("state") + ` (state, last_failure, id),
	KEY ` + idx("changed") + ` (state, updated_at),
	KEY ` + idx("uuid") + ` (uuid(` + strconv.Itoa(binPrefix) + `)),
	KEY ` + idx("key") + ` (dedupe_key(` + strconv.Itoa(binPrefix) + `))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`
		s.createGroups = "CREATE TABLE IF NOT EXISTS " + g + ` (
	group_id   VARCHAR(32)  NOT NULL PRIMARY KEY,
	handler    VARCHAR(600) NOT NULL,
	error_type VARCHAR(255) NOT NULL,
	norm_text  TEXT         NOT NULL,
	outcome    VARCHAR(32)  NOT NULL,
	parked     BIGINT       NOT NULL,
	total      BIGINT       NOT NULL,
	first_seen BIGINT       NOT NULL,
	last_seen  BIGINT       NOT NULL,
	KEY ` + gidx("seen") + ` (last_seen),
	KEY ` + gidx("handler") + ` (handler, last_seen)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`
		s.schema = []string{s.createRows, s.createGroups}
		// The no-op update makes a duplicate ident lock the existing
		// row instead of failing; INSERT IGNORE would also turn real
		// errors (a value too long) into warnings.
		s.insert = "INSERT INTO " + t + " (" + cols + ") VALUES (" + vals + ") ON DUPLICATE KEY UPDATE id = id"
		s.groupAdd = "INSERT INTO " + g + " (" + groupCols + ") VALUES (" + s.phs(9) + `)
ON DUPLICATE KEY UPDATE parked = parked + VALUES(parked), total = total + VALUES(total),
	first_seen = LEAST(first_seen, VALUES(first_seen)), last_seen = GREATEST(last_seen, VALUES(last_seen))`
	}
	s.find = `SELECT id, state, group_id, token, attempts, first_failure, last_failure FROM ` + t + ` WHERE ident = ` + s.ph(1) + s.lock
	s.refresh = `UPDATE ` + t + ` SET outcome = ` + s.ph(1) + `, reason = ` + s.ph(2) + `, group_id = ` + s.ph(3) + `, attempts = ` + s.ph(4) +
		`, first_failure = ` + s.ph(5) + `, last_failure = ` + s.ph(6) + `, trace_id = ` + s.ph(7) + `, updated_at = ` + s.ph(8) +
		` WHERE id = ` + s.ph(9)
	s.groupBump = `UPDATE ` + g + ` SET parked = parked + ` + s.ph(1) + `, total = total + ` + s.ph(2) + ` WHERE group_id = ` + s.ph(3)
	s.takeLock = `UPDATE ` + g + ` SET parked = parked WHERE 1 = 0`
	s.groupDrop = `DELETE FROM ` + g + ` WHERE group_id = ` + s.ph(1) + ` AND total <= 0`
	return s
}

// previewCols are the columns of the index that answers a preview of a
// group's replay (the console's confirmation page) from the index alone:
// every column Preview reads of a group's rows, so that the database does
// not read each of the group's rows, scattered over the table. On MariaDB
// at a million rows, with the rows read it took 6.6 s.
const previewCols = "group_id, state, last_failure, replay_count, topic"

// binPrefix is how many bytes of a UUID or key their indexes hold: a
// value of any length is stored, but an index entry is bounded (PostgreSQL
// refuses a row whose entry is over 2704 bytes).
const binPrefix = 255

// prefix is the indexed expression of the binary column col: its first
// binPrefix bytes on PostgreSQL, the column itself on SQLite (whose index
// entries have no bound; MySQL's key takes a prefix length instead).
func (s statements) prefix(col string) string {
	if s.d == sqldb.Postgres {
		return "substring(" + col + " from 1 for " + strconv.Itoa(binPrefix) + ")"
	}
	return col
}

// ph is the i-th placeholder (from 1) of a statement.
func (s statements) ph(i int) string {
	if s.d == sqldb.Postgres {
		return "$" + strconv.Itoa(i)
	}
	return "?"
}

// phs is the placeholders 1 to n, separated by commas.
func (s statements) phs(n int) string {
	p := make([]string, n)
	for i := range p {
		p[i] = s.ph(i + 1)
	}
	return strings.Join(p, ", ")
}

// builder writes a statement whose arguments are added as it is written.
type builder struct {
	d    sqldb.Dialect
	b    strings.Builder
	args []any
}

func (s statements) build() *builder { return &builder{d: s.d} }

// sql appends text.
func (b *builder) sql(text ...string) *builder {
	for _, t := range text {
		b.b.WriteString(t)
	}
	return b
}

// arg appends a placeholder bound to v.
func (b *builder) arg(v any) *builder {
	b.args = append(b.args, v)
	if b.d == sqldb.Postgres {
		b.b.WriteString("$" + strconv.Itoa(len(b.args)))
	} else {
		b.b.WriteString("?")
	}
	return b
}

// in appends "(p1, p2, ...)" bound to ids; ids must not be empty.
func (b *builder) in(ids []int64) *builder {
	b.b.WriteString("(")
	for i, id := range ids {
		if i > 0 {
			b.b.WriteString(", ")
		}
		b.arg(id)
	}
	b.b.WriteString(")")
	return b
}

func (b *builder) String() string { return b.b.String() }
