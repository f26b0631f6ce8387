// Package sqlitepubsub lets watermill-sql's own Publisher and Subscriber
// run on a SQLite file (modernc.org/sqlite).
//
// watermill-sql talks to a database through two adapters: a
// [wsql.SchemaAdapter] (the messages table of a topic and its statements)
// and a [wsql.OffsetsAdapter] (how far each consumer group got). It ships
// them for PostgreSQL and MySQL only. Those cannot serve SQLite: their DDL
// is PostgreSQL's and MySQL's, and their offsets adapters keep a consumer
// group exactly-once by locking its offset row with SELECT ... FOR UPDATE,
// which SQLite does not have.
// [Schema] and [Offsets] are the SQLite pair, built on what SQLite does have:
// one writer at a time.
//
//	schema, err := sqlitepubsub.Schema(sqlitepubsub.Config{})
//	...
//	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
//	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
//		SchemaAdapter: schema, OffsetsAdapter: sqlitepubsub.Offsets(sqlitepubsub.Config{}), ...
//	}, logger)
//
// The pair passes Watermill's own Pub/Sub conformance suite
// (pubsub/tests.TestPubSub) with consumer groups, exactly-once delivery,
// guaranteed order and persistence. This package is not settle's outbox:
// the outbox (package outbox) has its own table and relay and does not use
// it. It is for an application that wants watermill-sql itself on SQLite,
// e.g. as the broker of a single-process service or of its tests.
//
// # Tables
//
// One messages table per topic, "watermill_<topic>" unless
// [Config].GenerateMessagesTableName says otherwise:
//
//	"offset"     INTEGER PRIMARY KEY AUTOINCREMENT  -- never reused, even after deletes
//	"uuid"       TEXT NOT NULL                      -- the message UUID, any length
//	"created_at" TIMESTAMP NOT NULL                 -- UTC, millisecond precision
//	"payload"    BLOB                               -- bytes as published, not JSON
//	"metadata"   TEXT                               -- JSON object of the metadata (see below)
//
// and one offsets table per topic, "watermill_offsets_<topic>" unless
// [Config].GenerateMessagesOffsetsTableName says otherwise, with one row per
// consumer group:
//
//	"consumer_group"  TEXT PRIMARY KEY  -- "" for a subscriber without a group
//	"offset_acked"    INTEGER           -- the last offset the group acked
//	"offset_consumed" INTEGER           -- the last offset handed out; written
//	                                    -- before delivery to take the write lock
//
// The uuid column is TEXT, which SQLite does not bound: message UUIDs of any
// length are stored and delivered unchanged (watermill-sql's PostgreSQL and
// MySQL schemas hold 36 characters). The metadata column is the JSON object
// of the metadata's strings when they are all valid UTF-8; metadata with a
// key or value of other bytes is written as settle's outbox table writes it,
// {"settle_metadata_base64":{"<base64 key>":"<base64 value>",...}}, and
// delivered byte for byte.
//
// Each consumer group reads every message once, in offset order;
// subscribers sharing a group share the messages. A new consumer group
// starts at the first row still in the table, not at the newest. Rows may be
// deleted once every group has acked them: offsets are never reused.
//
// Neither adapter runs DDL by itself: the tables are created by the
// statements of SchemaInitializingQueries, which run when the watermill-sql
// subscriber's InitializeSchema or the publisher's AutoInitializeSchema is
// set, or when the caller runs them (the subscriber's SubscribeInitialize).
//
// # Ordering and exactly-once delivery
//
// SQLite has one writer at a time, and a transaction's row ids are taken
// while it holds the write lock, so rows commit in offset order and a
// subscriber that reads "offset > last acked" never skips a row committed
// late (the gap PostgreSQL's schema closes with transaction ids cannot
// happen here).
//
// Without SELECT ... FOR UPDATE, consumer groups stay exactly-once because
// the subscriber's poll transaction writes (the offsets adapter's
// ConsumedMessageQuery) before it hands out a message: that write needs the
// database's write lock, and with WAL it fails with SQLITE_BUSY if any other
// connection holds the lock or committed since this transaction read the
// offset, so no two subscribers can deliver the same row for one group. A
// subscriber that stops (or crashes) after handing out messages but before
// its poll transaction commits leaves their offsets unacked, and they are
// delivered again: exactly-once holds between live subscribers,
// at-least-once across crashes.
//
// Open the database with WAL, a busy timeout and _txlock=immediate:
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
//   - A subscriber holds SQLite's write lock from the start of a poll until
//     the batch's last message is acked. Every other writer on the file (the
//     application, other subscribers, settle's dedupe store) waits for it,
//     up to the busy timeout, then fails with SQLITE_BUSY. Keep handlers of
//     a SQLite subscriber short, keep [Config].SubscribeBatchSize moderate,
//     and set the subscriber's AckDeadline to a few seconds, below the busy
//     timeout.
//   - The lock is held while the subscriber waits for its consumer to take a
//     message: a subscriber whose output channel nobody reads (a router not
//     yet running, a handler busy elsewhere) holds it until the subscriber's
//     AckDeadline (watermill-sql's default is 30s), and takes it again at the
//     next poll. Read the channel as soon as you subscribe, and create the
//     tables before starting subscribers (run SubscribeInitialize once)
//     rather than setting InitializeSchema on many subscribers that start
//     one after another.
//   - A handler of a SQLite subscriber that writes to the same file must use
//     the subscriber's transaction (watermill-sql's TxFromContext), not the
//     *sql.DB: a second connection would wait for the lock its own delivery
//     holds, until the busy timeout.
//   - A publisher bound to an open transaction (wsql.TxFromStdSQL) holds the
//     write lock until that transaction ends; subscribers poll again after it.
//   - One Publish call writes at most [MaxPublishBatch] messages; more fail
//     with [ErrPublishBatchTooLarge] and write nothing.
//   - SQLite has one isolation level, serializable: the schema adapter's
//     SubscribeIsolationLevel says so, and modernc.org/sqlite accepts it (it
//     accepts any level and ignores it).
//
// Importing this package registers no database driver: open the file with
// modernc.org/sqlite ("sqlite") yourself.
package sqlitepubsub
