package parked

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// Defaults of Config.
const (
	defaultTable      = "settle_parked"
	defaultMaxReplays = 3
)

// maxTableName bounds the table's name (its last part, after a schema) so
// that Table + "_groups" is still an identifier of at most 63 bytes.
const maxTableName = 63 - len("_groups")

// Config configures a Store.
type Config struct {
	// Table names the parked-message table; the group counts live in
	// Table + "_groups". Defaults to "settle_parked". A name of letters,
	// digits and '_', optionally qualified by a schema ("app.parked"),
	// whose table part is at most 56 bytes (so that its "_groups" table's
	// name is at most 63).
	Table string
	// MaxReplays is the loop guard: a message replayed this many times
	// that failed again is refused by Replay unless ReplayOptions.Force is
	// set. Defaults to 3. Must be >= 1.
	MaxReplays int
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.Table == "" {
		c.Table = defaultTable
	}
	if c.MaxReplays == 0 {
		c.MaxReplays = defaultMaxReplays
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
	if err := sqlkit.ValidTable(c.Table); err != nil {
		return fmt.Errorf("parked: Config.Table: %w", err)
	}
	if n := len(c.Table) - strings.LastIndexByte(c.Table, '.') - 1; n > maxTableName {
		return fmt.Errorf("parked: Config.Table %q: the table's name is %d bytes, at most %d (its groups table adds \"_groups\")", c.Table, n, maxTableName)
	}
	if c.MaxReplays < 1 {
		return fmt.Errorf("parked: Config.MaxReplays must be >= 1, got %d", c.MaxReplays)
	}
	return nil
}

// State is the state of a parked row.
type State string

// The states of a row: parked (waiting for a person), replayed (a copy went
// back through the outbox), archived (kept for the record, never to be
// replayed). A row leaves parked once and never comes back to it.
const (
	StateParked   State = "parked"
	StateReplayed State = "replayed"
	StateArchived State = "archived"
)

func (s State) valid() bool {
	return s == StateParked || s == StateReplayed || s == StateArchived
}

// Message is one row of the store: a parked message and what is known of
// its failure and its replays. Text the store could not keep as it was
// (invalid UTF-8 and NUL bytes in Handler, Topic, Reason, ReplayedBy,
// ArchivedBy) reads back with U+FFFD in their place; UUID, Key, Payload and
// Metadata read back exactly as they were parked.
type Message struct {
	ID           int64
	Handler      string
	Topic        string // the topic the handler consumed it from
	UUID         string
	Key          string // dedupe key, "" when none
	Outcome      settle.Outcome
	Reason       string // the error's text, at most 16 KiB
	Group        string // the failure group's id (see Group.ID)
	Attempts     int
	FirstFailure time.Time // zero when unknown
	LastFailure  time.Time
	TraceID      string
	// Payload and Metadata are the message's; List leaves them nil (Get
	// returns them), so that a page stays small whatever the messages'
	// size.
	Payload  []byte
	Metadata message.Metadata
	State    State
	// Replays is how many times the message was replayed: by this row,
	// and before it was parked (a replayed copy that failed again is parked
	// in a row of its own, which starts at the copy's
	// settle_replay_count).
	Replays    int
	ReplayedAt time.Time // the last replay; zero when never
	ReplayedBy string    // who asked for the last replay
	ArchivedAt time.Time // zero unless archived
	ArchivedBy string    // who archived it
}

// Group is a failure group: one handler, one outcome, one error type, one
// normalised error text.
type Group struct {
	ID        string // stable id: a hash of handler, outcome, error type and text
	Handler   string
	ErrorType string // Go type of the innermost error, e.g. "*json.SyntaxError"
	Text      string // the normalised error text
	Outcome   settle.Outcome
	Parked    int64 // rows in state parked
	Total     int64 // rows in any state
	FirstSeen time.Time
	LastSeen  time.Time
}

// Filter selects rows. Zero fields select everything; set fields are ANDed.
type Filter struct {
	// IDs selects these rows (at most 10,000).
	IDs     []int64
	Handler string
	Topic   string
	Outcome settle.Outcome
	Group   string
	// State selects one state; "" selects every state.
	State State
	// Reason selects rows whose reason contains this text (case
	// sensitive; % and _ are plain characters).
	Reason string
	UUID   string
	Key    string
	// Since and Until bound the last failure: Since <= t < Until.
	Since, Until time.Time
}

// maxIDs bounds Filter.IDs: each is a bound parameter.
const maxIDs = 10000

func (f Filter) validate() error {
	if f.State != "" && !f.State.valid() {
		return invalidf("Filter.State %q is not parked, replayed or archived", string(f.State))
	}
	if len(f.IDs) > maxIDs {
		return invalidf("Filter.IDs has %d ids, at most %d", len(f.IDs), maxIDs)
	}
	return nil
}

// Query is a Filter with a page: rows come newest last failure first, then
// by descending ID.
type Query struct {
	Filter
	// Cursor continues after the last row of a previous page (Page.Next)
	// of the same Filter. A row parked after the first page was read comes
	// in a later page only if its last failure is older than the cursor's;
	// a row is never in two pages unless it was parked again (its last
	// failure moved) in between.
	Cursor string
	// Limit is the page size. Defaults to 50. Must be 0-1000.
	Limit int
}

// Default and bound of Query.Limit.
const (
	defaultLimit = 50
	maxLimit     = 1000
)

// Page is one page of rows.
type Page struct {
	Messages []Message
	// Next is the cursor of the next page, "" after the last.
	Next string
}

// ReplayOptions say where and how a replay goes.
type ReplayOptions struct {
	// Topic, when set, sends every copy there instead of each message's
	// original topic.
	Topic string
	// By names who asked for the replay (recorded on the row and in the
	// copy's settle_replayed_by metadata), at most 255 characters.
	By string
	// Force replays messages the loop guard refuses (replayed
	// Config.MaxReplays times already).
	Force bool
	// Progress, if set, is called by Replay after each transaction it
	// commits, with what the replay has done so far, on the replay's
	// goroutine: a long replay can say how far it is. Preview does not
	// call it.
	Progress func(sofar ReplayResult)
}

// ReplayResult says what a replay did, or would do (Preview).
type ReplayResult struct {
	// Replayed is the number of messages replayed.
	Replayed int64
	// Refused is the number of selected parked messages the loop guard
	// refused.
	Refused int64
	// Skipped is the number of selected rows not in state parked (a
	// concurrent replay or archive took them first, or they were never
	// parked), of parked rows with no topic when ReplayOptions.Topic
	// is not set, and on MySQL of parked rows whose destination topic is
	// longer than the outbox's topic column takes (255 characters).
	Skipped int64
	// Destinations counts the copies per destination topic.
	Destinations map[string]int64
}

// ErrNotFound is returned by Get for an id with no row.
var ErrNotFound = errors.New("parked: no such message")

// ErrInvalid is wrapped by the error of a call given a Filter or Query it
// cannot take (a State that is none of the states, too many IDs, a Cursor
// that List did not make, a Limit out of range): the caller's input is at
// fault, not the database. An application serving the store's rows over
// HTTP answers it with 400.
var ErrInvalid = errors.New("parked: invalid filter or query")

// invalid is an error wrapping ErrInvalid whose text is its own.
type invalid struct{ msg string }

func (e invalid) Error() string        { return e.msg }
func (e invalid) Is(target error) bool { return target == ErrInvalid }

func invalidf(format string, args ...any) error { return invalid{fmt.Sprintf(format, args...)} }

// Store is the parked-message store of one database. It is a
// settle.ParkStore. TTx is the transaction type of the driver. A Store holds
// no connection of its own and needs no Close; it is safe for concurrent use.
type Store[TTx any] struct {
	db  sqldb.Driver[TTx]
	cfg Config
	q   statements
	// chunk is the most rows of one transaction of Replay (replayChunk;
	// tests make it small).
	chunk int
	// scan is the most rows a bounded page of List reads (listScan;
	// tests make it smaller).
	scan int
}

// New checks cfg and returns the store of db. It touches no database.
func New[TTx any](db sqldb.Driver[TTx], cfg Config) (*Store[TTx], error) {
	if db == nil {
		return nil, errors.New("parked: New: db is nil")
	}
	if err := sqlkit.ValidDialect(db.Dialect()); err != nil {
		return nil, fmt.Errorf("parked: New: %w", err)
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Store[TTx]{db: db, cfg: cfg, q: newStatements(db.Dialect(), cfg.Table), chunk: replayChunk, scan: listScan}, nil
}

// Schema returns the DDL of the store's tables and indexes, in the
// driver's dialect, for your migrations: the rows table, and the groups
// table (Table + "_groups") that holds the counts of each failure group.
// Run them outside any transaction of the application. The library never
// runs them by itself.
func (s *Store[TTx]) Schema() []string { return slices.Clone(s.q.schema) }

// Check reports whether the tables exist as the store needs them: an error
// wrapping sqldb.ErrSchema (a *sqldb.SchemaError with the DDL) when a table
// is missing or lacks a column, or has one of another kind. Other errors
// are the database's. Call it where the service starts. It reads no rows
// and writes nothing.
func (s *Store[TTx]) Check(ctx context.Context) error {
	ex := s.db.DB()
	if err := ex.QueryRow(ctx, "SELECT 1", nil, new(int)); err != nil {
		return fmt.Errorf("parked: check: the database does not answer: %w", err)
	}
	for _, t := range []struct{ name, quoted, create string }{
		{s.q.table, s.q.t, s.q.createRows},
		{s.q.groups, s.q.g, s.q.createGroups},
	} {
		have, err := ex.Columns(ctx, "SELECT * FROM "+t.quoted+" WHERE 1 = 0")
		if err != nil {
			return &sqldb.SchemaError{Table: t.name, Problem: fmt.Sprintf("it cannot be read (%v)", err),
				Fix: "create the tables with the statements of Store.Schema", DDL: s.Schema()}
		}
		if col, problem := sqlkit.Mismatch(have, t.create); col != "" {
			return &sqldb.SchemaError{Table: t.name, Problem: problem,
				Fix: "drop and create the tables with the statements of Store.Schema", DDL: s.Schema()}
		}
	}
	return nil
}

// txOptions are the options of the store's own transactions: READ
// COMMITTED where there is a choice (every decision is made from a locking
// read or from what a statement wrote, and MySQL's default level would lock
// gaps where other writers insert).
func (s *Store[TTx]) txOptions() *sql.TxOptions {
	if s.db.Dialect() == sqldb.SQLite {
		return nil
	}
	return &sql.TxOptions{Isolation: sql.LevelReadCommitted}
}

// maxRetries bounds the runs of one transaction that the database rolled
// back to break a deadlock or a conflict.
const maxRetries = 8

// inTx runs fn in a transaction of its own and commits it, again (up to
// maxRetries) when the database rolled it back to break a deadlock. The
// rollback is deferred, so a panic leaves no transaction open.
func (s *Store[TTx]) inTx(ctx context.Context, fn func(tx TTx, ex sqldb.Executor) error) error {
	for attempt := 1; ; attempt++ {
		err := s.runTx(ctx, fn)
		if err == nil || attempt == maxRetries || ctx.Err() != nil || !(sqlkit.Deadlock(err) || sqlkit.Conflict(err)) {
			return err
		}
		s.cfg.Logger.Debug("parked: transaction rolled back by the database, run again", watermill.LogFields{"error": err.Error(), "attempt": attempt})
	}
}

func (s *Store[TTx]) runTx(ctx context.Context, fn func(tx TTx, ex sqldb.Executor) error) error {
	tx, err := s.db.Begin(ctx, s.txOptions(), "")
	if err != nil {
		return err
	}
	defer func() { _ = s.db.Rollback(context.WithoutCancel(ctx), tx) }()
	if s.db.Dialect() == sqldb.SQLite {
		// Take the write lock first, as _txlock=immediate would: a
		// deferred transaction that has read cannot wait for the lock
		// when it comes to write (SQLite answers SQLITE_BUSY at once),
		// but its first statement waits out the busy timeout.
		if _, err := s.db.Tx(tx).Exec(ctx, s.q.takeLock); err != nil {
			return err
		}
	}
	if err := fn(tx, s.db.Tx(tx)); err != nil {
		return err
	}
	return s.db.Commit(ctx, tx)
}
