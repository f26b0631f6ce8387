package outbox

import (
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultSubscribeBatchSize is the number of rows one poll of a SQLite
// subscriber reads when [SQLiteSchema.SubscribeBatchSize] is 0.
const DefaultSubscribeBatchSize = 100

// SQLiteMaxPublishBatch is the most messages one Publish call can write to
// SQLite: each message takes 3 of the 32766 bound parameters SQLite allows in
// one statement.
const SQLiteMaxPublishBatch = sqliteMaxParams / 3

const sqliteMaxParams = 32766

// ErrPublishBatchTooLarge is returned (wrapped) by [SQLiteSchema.InsertQuery]
// when one Publish call carries more than [SQLiteMaxPublishBatch] messages.
var ErrPublishBatchTooLarge = errors.New("outbox: too many messages in one SQLite publish")

// ErrInvalidBatchSize is returned (wrapped) by [SQLiteSchema.Validate] and
// [SQLiteSchema.SelectQuery] when SubscribeBatchSize is negative.
var ErrInvalidBatchSize = errors.New("outbox: SubscribeBatchSize must be >= 0")

// SQLiteSchema is a watermill-sql [wsql.SchemaAdapter] for SQLite through
// modernc.org/sqlite. With [SQLiteOffsetsAdapter] it makes a watermill-sql
// Publisher and Subscriber work on a SQLite file: the publisher inserts rows
// into one table per topic, the subscriber reads them in offset order and
// records per consumer group how far it got.
//
// One table per topic, named by [SQLiteSchema.MessagesTable]:
//
//	"offset"     INTEGER PRIMARY KEY AUTOINCREMENT  -- never reused, even after deletes
//	"uuid"       TEXT NOT NULL                      -- the message UUID, any length
//	"created_at" TIMESTAMP NOT NULL                 -- UTC, millisecond precision
//	"payload"    BLOB                               -- bytes as published, not JSON
//	"metadata"   TEXT                               -- JSON object of the metadata (see below)
//
// The uuid column is TEXT, which SQLite does not bound: message UUIDs of any
// length are stored and delivered unchanged (watermill-sql's PostgreSQL and
// MySQL schemas hold 36 characters). The metadata column is the JSON object
// of the metadata's strings when they are all valid UTF-8; metadata with a
// key or value of other bytes is written as the outbox table writes it,
// {"settle_metadata_base64":{"<base64 key>":"<base64 value>",...}}, and
// delivered byte for byte.
//
// # Ordering and exactly-once delivery
//
// SQLite has one writer at a time, and a transaction's row ids are taken while
// it holds the write lock, so rows commit in offset order and a subscriber
// that reads "offset > last acked" never skips a row committed late (the gap
// PostgreSQL's schema handles with transaction ids cannot happen here).
//
// SQLite has no SELECT ... FOR UPDATE. Consumer groups stay exactly-once
// because the subscriber's poll transaction writes (through
// [SQLiteOffsetsAdapter.ConsumedMessageQuery]) before it hands out a message:
// that write needs the database's write lock, and with WAL it fails with
// SQLITE_BUSY if any other connection holds the lock or committed since this
// transaction read the offset, so no two subscribers can deliver the same
// row for one group. A subscriber that stops (or crashes) after handing out
// messages but before its poll transaction commits leaves their offsets
// unacked, and they are delivered again: exactly-once holds between live
// subscribers, at-least-once across crashes.
//
// Open the database with WAL, a busy timeout and _txlock=immediate, as
// settle's sqlite:// URLs do:
//
//	file:app.db?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate
//
// BEGIN IMMEDIATE then takes the write lock at the start of each poll, and a
// subscriber waits its turn (up to the busy timeout) instead of failing at
// once. Without it, delivery is still exactly-once, but a poll that meets
// another writer fails with SQLITE_BUSY, which the watermill-sql subscriber
// logs as an error and retries after its RetryInterval.
//
// # Limits
//
//   - A subscriber holds SQLite's write lock from the start of a poll until the
//     batch's last message is acked. Every other writer on the file (the
//     application, other subscribers, dedupe) waits for it, up to the busy
//     timeout, then fails with SQLITE_BUSY. Keep handlers of a SQLite
//     subscriber short (the outbox forwarder only republishes), keep
//     SubscribeBatchSize moderate, and set the subscriber's AckDeadline to a
//     few seconds, below the busy timeout.
//   - The lock is held while the subscriber waits for its consumer to take
//     a message: a subscriber whose output channel nobody reads (a router not
//     yet running, a handler busy elsewhere) holds it until the subscriber's
//     AckDeadline (watermill-sql's default is 30s), and takes it again at the
//     next poll. Read the channel as soon as you subscribe, and create the
//     tables before starting subscribers (run SchemaInitializingQueries or
//     SubscribeInitialize once) rather than setting InitializeSchema on many
//     subscribers that start one after another.
//   - A handler of a SQLite subscriber that writes to the same file must use
//     the subscriber's transaction (watermill-sql's TxFromContext), not the
//     *sql.DB: a second connection would wait for the lock its own delivery
//     holds, until the busy timeout.
//   - A publisher bound to an open transaction (wsql.TxFromStdSQL) holds the
//     write lock until that transaction ends; subscribers poll again after it.
//   - One Publish call writes at most [SQLiteMaxPublishBatch] messages.
//   - SQLite has one isolation level, serializable:
//     [SQLiteSchema.SubscribeIsolationLevel] says so, and modernc.org/sqlite
//     accepts it (it accepts any level and ignores it).
//
// The zero value is ready to use. SQLiteSchema never runs DDL by itself: its
// SchemaInitializingQueries run when the watermill-sql subscriber's
// InitializeSchema or the publisher's AutoInitializeSchema is set, or when the
// caller runs them.
type SQLiteSchema struct {
	// GenerateMessagesTableName returns the table name of a topic, already
	// quoted for SQLite. It is spliced into SQL as is, so it must never be
	// built from message data. Defaults to "watermill_<topic>" in double
	// quotes (watermill-sql's default names).
	GenerateMessagesTableName func(topic string) string

	// SubscribeBatchSize is the most rows one poll reads and delivers inside
	// one transaction. A crash redelivers at most this many messages, and the
	// write lock is held while they are handled. Defaults to
	// DefaultSubscribeBatchSize (100) when 0. Must be >= 0.
	SubscribeBatchSize int
}

var (
	_ wsql.SchemaAdapter  = SQLiteSchema{}
	_ wsql.OffsetsAdapter = SQLiteOffsetsAdapter{}
)

// Validate reports a configuration the adapter cannot work with.
func (s SQLiteSchema) Validate() error {
	if s.SubscribeBatchSize < 0 {
		return fmt.Errorf("%w, got %d", ErrInvalidBatchSize, s.SubscribeBatchSize)
	}
	return nil
}

// MessagesTable returns the quoted name of topic's messages table.
func (s SQLiteSchema) MessagesTable(topic string) string {
	if s.GenerateMessagesTableName != nil {
		return s.GenerateMessagesTableName(topic)
	}
	return `"watermill_` + topic + `"`
}

// SchemaInitializingQueries returns the CREATE TABLE IF NOT EXISTS statement
// of topic's messages table.
func (s SQLiteSchema) SchemaInitializingQueries(params wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + s.MessagesTable(params.Topic) + ` (
	"offset" INTEGER PRIMARY KEY AUTOINCREMENT,
	"uuid" TEXT NOT NULL,
	"created_at" TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
	"payload" BLOB,
	"metadata" TEXT
)`}}, nil
}

// InsertQuery returns one INSERT of all params.Msgs, in order. With no
// messages it returns a statement that does nothing.
func (s SQLiteSchema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if len(params.Msgs) == 0 {
		return wsql.Query{Query: `SELECT 1 WHERE 0`}, nil
	}
	if len(params.Msgs) > SQLiteMaxPublishBatch {
		return wsql.Query{}, fmt.Errorf("%w: %d messages, at most %d", ErrPublishBatchTooLarge, len(params.Msgs), SQLiteMaxPublishBatch)
	}
	args := make([]any, 0, 3*len(params.Msgs))
	for _, msg := range params.Msgs {
		metadata, err := encodeMetadata(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("outbox: marshal metadata of message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), metadata)
	}
	q := `INSERT INTO ` + s.MessagesTable(params.Topic) + ` ("uuid", "payload", "metadata") VALUES ` +
		strings.TrimSuffix(strings.Repeat(`(?, ?, ?), `, len(params.Msgs)), ", ")
	return wsql.Query{Query: q, Args: args}, nil
}

// SelectQuery returns the query of the next batch of rows after the consumer
// group's acked offset, oldest first.
func (s SQLiteSchema) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if err := s.Validate(); err != nil {
		return wsql.Query{}, err
	}
	if params.OffsetsAdapter == nil {
		return wsql.Query{}, errors.New("outbox: SelectQuery needs an offsets adapter")
	}
	next, err := params.OffsetsAdapter.NextOffsetQuery(wsql.NextOffsetQueryParams{
		Topic:         params.Topic,
		ConsumerGroup: params.ConsumerGroup,
	})
	if err != nil {
		return wsql.Query{}, err
	}
	batch := s.SubscribeBatchSize
	if batch == 0 {
		batch = DefaultSubscribeBatchSize
	}
	q := `SELECT "offset", "uuid", "payload", "metadata" FROM ` + s.MessagesTable(params.Topic) +
		` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" ASC LIMIT ` + strconv.Itoa(batch)
	return wsql.Query{Query: q, Args: next.Args}, nil
}

// UnmarshalMessage turns a row of SelectQuery into a message.
func (s SQLiteSchema) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	var r wsql.Row
	var metadata sql.NullString
	if err := params.Row.Scan(&r.Offset, &r.UUID, &r.Payload, &metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("outbox: scan message row: %w", err)
	}
	msg := message.NewMessage(string(r.UUID), r.Payload)
	if metadata.Valid {
		r.Metadata = []byte(metadata.String)
		md, err := decodeMetadata(metadata.String)
		if err != nil {
			return wsql.Row{}, fmt.Errorf("outbox: unmarshal metadata of message %s (offset %d): %w", msg.UUID, r.Offset, err)
		}
		msg.Metadata = md
	}
	r.Msg = msg
	return r, nil
}

// SubscribeIsolationLevel returns sql.LevelSerializable, the only level
// SQLite has. modernc.org/sqlite accepts any level and begins the transaction
// as its DSN's _txlock says.
func (s SQLiteSchema) SubscribeIsolationLevel() sql.IsolationLevel {
	return sql.LevelSerializable
}

// SQLiteOffsetsAdapter is a watermill-sql [wsql.OffsetsAdapter] for SQLite,
// to use with [SQLiteSchema]. It keeps one row per consumer group in one
// offsets table per topic:
//
//	"consumer_group"  TEXT PRIMARY KEY  -- "" for a subscriber without a group
//	"offset_acked"    INTEGER           -- the last offset the group acked
//	"offset_consumed" INTEGER           -- the last offset handed out; written
//	                                    -- before delivery to take the write lock
//
// Each consumer group reads every message once, in offset order; subscribers
// sharing a group share the messages. See [SQLiteSchema] for why this is
// exactly-once without SELECT ... FOR UPDATE, and for the locking limits.
//
// A new consumer group starts at the first row still in the table, not at the
// newest. The zero value is ready to use.
type SQLiteOffsetsAdapter struct {
	// GenerateMessagesOffsetsTableName returns the offsets table name of a
	// topic, already quoted for SQLite. It is spliced into SQL as is, so it
	// must never be built from message data. Defaults to
	// "watermill_offsets_<topic>" in double quotes.
	GenerateMessagesOffsetsTableName func(topic string) string
}

// MessagesOffsetsTable returns the quoted name of topic's offsets table.
func (a SQLiteOffsetsAdapter) MessagesOffsetsTable(topic string) string {
	if a.GenerateMessagesOffsetsTableName != nil {
		return a.GenerateMessagesOffsetsTableName(topic)
	}
	return `"watermill_offsets_` + topic + `"`
}

// SchemaInitializingQueries returns the CREATE TABLE IF NOT EXISTS statement
// of topic's offsets table.
func (a SQLiteOffsetsAdapter) SchemaInitializingQueries(params wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + a.MessagesOffsetsTable(params.Topic) + ` (
	"consumer_group" TEXT NOT NULL PRIMARY KEY,
	"offset_acked" INTEGER NOT NULL DEFAULT 0,
	"offset_consumed" INTEGER NOT NULL DEFAULT 0
)`}}, nil
}

// NextOffsetQuery returns the query of the consumer group's last acked
// offset, 0 when the group has none.
func (a SQLiteOffsetsAdapter) NextOffsetQuery(params wsql.NextOffsetQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT "offset_acked" FROM ` + a.MessagesOffsetsTable(params.Topic) +
			` WHERE "consumer_group" = ?), 0)`,
		Args: []any{params.ConsumerGroup},
	}, nil
}

// ConsumedMessageQuery returns the write the subscriber runs, in its poll
// transaction, before it delivers a row. It records the row as handed out,
// and, more to the point, takes SQLite's write lock: a subscriber whose read
// of the offsets has gone stale fails here, before delivering anything.
func (a SQLiteOffsetsAdapter) ConsumedMessageQuery(params wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `INSERT INTO ` + a.MessagesOffsetsTable(params.Topic) +
			` ("consumer_group", "offset_acked", "offset_consumed") VALUES (?, 0, ?)` +
			` ON CONFLICT ("consumer_group") DO UPDATE SET "offset_consumed" = excluded."offset_consumed"`,
		Args: []any{params.ConsumerGroup, params.Row.Offset},
	}, nil
}

// AckMessageQuery returns the write that moves the consumer group's acked
// offset to the last acked row of the batch; it commits with the poll
// transaction.
func (a SQLiteOffsetsAdapter) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `INSERT INTO ` + a.MessagesOffsetsTable(params.Topic) +
			` ("consumer_group", "offset_acked", "offset_consumed") VALUES (?, ?, ?)` +
			` ON CONFLICT ("consumer_group") DO UPDATE SET "offset_acked" = excluded."offset_acked",` +
			` "offset_consumed" = excluded."offset_consumed"`,
		Args: []any{params.ConsumerGroup, params.LastRow.Offset, params.LastRow.Offset},
	}, nil
}

// BeforeSubscribingQueries returns no queries: Subscribe then needs no
// write lock, so a subscriber can subscribe while another one of the same
// file holds the lock in the middle of a batch. A consumer group gets its row
// at its first poll that finds a message.
func (a SQLiteOffsetsAdapter) BeforeSubscribingQueries(params wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return nil, err
	}
	return nil, nil
}

// disallowedTopicChars is watermill-sql's own rule (pkg/sql/topic.go), which
// it does not export: topics name tables and are spliced into queries.
var disallowedTopicChars = regexp.MustCompile(`[^A-Za-z0-9\-\$\:\.\_]`)

// validateTopic applies watermill-sql's topic rule, so the adapters are safe
// to call directly too (the Publisher and Subscriber check it first).
func validateTopic(topic string) error {
	if topic == "" {
		return fmt.Errorf("outbox: empty topic: %w", wsql.ErrInvalidTopicName)
	}
	if disallowedTopicChars.MatchString(topic) {
		return fmt.Errorf("%s: %w", topic, wsql.ErrInvalidTopicName)
	}
	return nil
}
