package sqlitepubsub

import (
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/internal/mdcolumn"
)

// MaxPublishBatch is the most messages one Publish call can write: each
// message takes 3 of the 32766 bound parameters SQLite allows in one
// statement, and a Publish call is one statement.
const MaxPublishBatch = sqliteMaxParams / 3

const sqliteMaxParams = 32766

// ErrPublishBatchTooLarge is returned (wrapped) by a Publish call of more
// than [MaxPublishBatch] messages; none of them is written.
var ErrPublishBatchTooLarge = errors.New("sqlitepubsub: too many messages in one publish")

// defaultSubscribeBatchSize is SubscribeBatchSize when it is 0.
const defaultSubscribeBatchSize = 100

// Config configures the adapters. The zero value is ready to use and names
// the tables as watermill-sql does. Pass the same Config to [Schema] and
// [Offsets].
type Config struct {
	// GenerateMessagesTableName returns the messages table name of a topic,
	// already quoted for SQLite. It is spliced into SQL as is, so it must
	// never be built from message data. Used by [Schema]. Defaults to
	// "watermill_<topic>" in double quotes.
	GenerateMessagesTableName func(topic string) string

	// GenerateMessagesOffsetsTableName returns the offsets table name of a
	// topic, already quoted for SQLite, spliced into SQL as is. Used by
	// [Offsets]. Defaults to "watermill_offsets_<topic>" in double quotes.
	GenerateMessagesOffsetsTableName func(topic string) string

	// SubscribeBatchSize is the most rows one poll of a subscriber reads and
	// delivers inside one transaction. A crash redelivers at most this many
	// messages, and the write lock is held while they are handled. Used by
	// [Schema]. Defaults to 100 when 0. Must be >= 0.
	SubscribeBatchSize int
}

// Schema returns the watermill-sql schema adapter for SQLite, for a
// Publisher and a Subscriber; the Subscriber also needs [Offsets]. It
// returns an error naming the field when cfg is invalid.
func Schema(cfg Config) (wsql.SchemaAdapter, error) {
	if cfg.SubscribeBatchSize < 0 {
		return nil, fmt.Errorf("sqlitepubsub: Config.SubscribeBatchSize must be >= 0, got %d", cfg.SubscribeBatchSize)
	}
	s := schema{table: cfg.GenerateMessagesTableName, batch: cfg.SubscribeBatchSize}
	if s.table == nil {
		s.table = func(topic string) string { return `"watermill_` + topic + `"` }
	}
	if s.batch == 0 {
		s.batch = defaultSubscribeBatchSize
	}
	return s, nil
}

// Offsets returns the watermill-sql offsets adapter for SQLite, for a
// Subscriber whose schema adapter is [Schema]'s.
func Offsets(cfg Config) wsql.OffsetsAdapter {
	o := offsets{table: cfg.GenerateMessagesOffsetsTableName}
	if o.table == nil {
		o.table = func(topic string) string { return `"watermill_offsets_` + topic + `"` }
	}
	return o
}

type schema struct {
	table func(topic string) string
	batch int
}

func (s schema) SchemaInitializingQueries(params wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + s.table(params.Topic) + ` (
	"offset" INTEGER PRIMARY KEY AUTOINCREMENT,
	"uuid" TEXT NOT NULL,
	"created_at" TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
	"payload" BLOB,
	"metadata" TEXT
)`}}, nil
}

// InsertQuery is one INSERT of every message, in order; with no messages, a
// statement that does nothing.
func (s schema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if len(params.Msgs) == 0 {
		return wsql.Query{Query: `SELECT 1 WHERE 0`}, nil
	}
	if len(params.Msgs) > MaxPublishBatch {
		return wsql.Query{}, fmt.Errorf("%w: %d messages, at most %d", ErrPublishBatchTooLarge, len(params.Msgs), MaxPublishBatch)
	}
	args := make([]any, 0, 3*len(params.Msgs))
	for _, msg := range params.Msgs {
		metadata, err := mdcolumn.Encode(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("sqlitepubsub: metadata of message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), metadata)
	}
	q := `INSERT INTO ` + s.table(params.Topic) + ` ("uuid", "payload", "metadata") VALUES ` +
		strings.TrimSuffix(strings.Repeat(`(?, ?, ?), `, len(params.Msgs)), ", ")
	return wsql.Query{Query: q, Args: args}, nil
}

// SelectQuery reads the next batch after the group's acked offset, oldest
// first.
func (s schema) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if params.OffsetsAdapter == nil {
		return wsql.Query{}, errors.New("sqlitepubsub: SelectQuery needs an offsets adapter")
	}
	next, err := params.OffsetsAdapter.NextOffsetQuery(wsql.NextOffsetQueryParams{
		Topic:         params.Topic,
		ConsumerGroup: params.ConsumerGroup,
	})
	if err != nil {
		return wsql.Query{}, err
	}
	q := `SELECT "offset", "uuid", "payload", "metadata" FROM ` + s.table(params.Topic) +
		` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" ASC LIMIT ` + strconv.Itoa(s.batch)
	return wsql.Query{Query: q, Args: next.Args}, nil
}

func (s schema) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	var r wsql.Row
	var metadata sql.NullString
	if err := params.Row.Scan(&r.Offset, &r.UUID, &r.Payload, &metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("sqlitepubsub: scan message row: %w", err)
	}
	msg := message.NewMessage(string(r.UUID), r.Payload)
	if metadata.Valid {
		r.Metadata = []byte(metadata.String)
		md, err := mdcolumn.Decode(metadata.String)
		if err != nil {
			return wsql.Row{}, fmt.Errorf("sqlitepubsub: metadata of message %s (offset %d): %w", msg.UUID, r.Offset, err)
		}
		msg.Metadata = md
	}
	r.Msg = msg
	return r, nil
}

// SubscribeIsolationLevel is the only level SQLite has. modernc.org/sqlite
// accepts any level and begins the transaction as its DSN's _txlock says.
func (s schema) SubscribeIsolationLevel() sql.IsolationLevel {
	return sql.LevelSerializable
}

type offsets struct {
	table func(topic string) string
}

func (o offsets) SchemaInitializingQueries(params wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + o.table(params.Topic) + ` (
	"consumer_group" TEXT NOT NULL PRIMARY KEY,
	"offset_acked" INTEGER NOT NULL DEFAULT 0,
	"offset_consumed" INTEGER NOT NULL DEFAULT 0
)`}}, nil
}

// NextOffsetQuery reads the group's last acked offset, 0 when it has none.
func (o offsets) NextOffsetQuery(params wsql.NextOffsetQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT "offset_acked" FROM ` + o.table(params.Topic) +
			` WHERE "consumer_group" = ?), 0)`,
		Args: []any{params.ConsumerGroup},
	}, nil
}

// ConsumedMessageQuery is the write the subscriber runs, in its poll
// transaction, before it delivers a row. It records the row as handed out
// and, more to the point, takes SQLite's write lock: a subscriber whose read
// of the offsets has gone stale fails here, before delivering anything.
func (o offsets) ConsumedMessageQuery(params wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `INSERT INTO ` + o.table(params.Topic) +
			` ("consumer_group", "offset_acked", "offset_consumed") VALUES (?, 0, ?)` +
			` ON CONFLICT ("consumer_group") DO UPDATE SET "offset_consumed" = excluded."offset_consumed"`,
		Args: []any{params.ConsumerGroup, params.Row.Offset},
	}, nil
}

// AckMessageQuery moves the group's acked offset to the batch's last acked
// row; it commits with the poll transaction.
func (o offsets) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	if err := validateTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `INSERT INTO ` + o.table(params.Topic) +
			` ("consumer_group", "offset_acked", "offset_consumed") VALUES (?, ?, ?)` +
			` ON CONFLICT ("consumer_group") DO UPDATE SET "offset_acked" = excluded."offset_acked",` +
			` "offset_consumed" = excluded."offset_consumed"`,
		Args: []any{params.ConsumerGroup, params.LastRow.Offset, params.LastRow.Offset},
	}, nil
}

// BeforeSubscribingQueries is none: Subscribe then needs no write lock, so a
// subscriber can subscribe while another one of the same file holds the lock
// in the middle of a batch. A group gets its row at its first poll that
// finds a message.
func (o offsets) BeforeSubscribingQueries(params wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
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
		return fmt.Errorf("sqlitepubsub: empty topic: %w", wsql.ErrInvalidTopicName)
	}
	if disallowedTopicChars.MatchString(topic) {
		return fmt.Errorf("sqlitepubsub: %s: %w", topic, wsql.ErrInvalidTopicName)
	}
	return nil
}
