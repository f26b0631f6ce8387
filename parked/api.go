package parked

// API skeleton written first so that the store, the command line and the
// console can be built in parallel. Bodies are filled in by the store's
// implementation.

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// Config configures a Store.
type Config struct {
	// Table names the parked-message table; the group counts live in
	// Table + "_groups". Defaults to "settle_parked". A name of letters,
	// digits and '_' (optionally schema-qualified), at most 63 bytes.
	Table string
	// MaxReplays is the loop guard: a message replayed this many times
	// that failed again is refused by Replay unless ReplayOptions.Force is
	// set. Defaults to 3. Must be >= 1.
	MaxReplays int
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// State is the state of a parked row.
type State string

// The states of a row: parked (waiting for a person), replayed (a copy went
// back through the outbox), archived (kept for the record, never to be
// replayed).
const (
	StateParked   State = "parked"
	StateReplayed State = "replayed"
	StateArchived State = "archived"
)

// Message is one row of the store: a parked message and what is known of
// its failure and its replays.
type Message struct {
	ID           int64
	Handler      string
	Topic        string // the topic the handler consumed it from
	UUID         string
	Key          string // dedupe key, "" when none
	Outcome      settle.Outcome
	Reason       string
	Group        string // the failure group's id (see Group.ID)
	Attempts     int
	FirstFailure time.Time
	LastFailure  time.Time
	TraceID      string
	Payload      []byte
	Metadata     message.Metadata
	State        State
	Replays      int       // how many times it was replayed
	ReplayedAt   time.Time // the last replay; zero when never
	ReplayedBy   string    // who asked for the last replay
	ArchivedAt   time.Time // zero unless archived
}

// Group is a failure group: one handler, one error type, one normalised
// error text.
type Group struct {
	ID        string // stable id: a hash of handler, error type and text
	Handler   string
	ErrorType string // Go type of the innermost error, e.g. "*net.OpError"
	Text      string // the normalised error text
	Outcome   settle.Outcome
	Parked    int64 // rows in state parked
	Total     int64 // rows in any state
	FirstSeen time.Time
	LastSeen  time.Time
}

// Filter selects rows. Zero fields select everything; set fields are ANDed.
type Filter struct {
	IDs     []int64
	Handler string
	Topic   string
	Outcome settle.Outcome
	Group   string
	// State selects one state; "" selects every state.
	State State
	// Reason selects rows whose reason contains this text.
	Reason string
	UUID   string
	Key    string
	// Since and Until bound the last failure: Since <= t < Until.
	Since, Until time.Time
}

// Query is a Filter with a page: rows come newest last failure first, then
// by descending ID.
type Query struct {
	Filter
	// Cursor continues after the last row of a previous page (Page.Next).
	Cursor string
	// Limit is the page size. Defaults to 50; at most 1000.
	Limit int
}

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
	// copy's settle_replayed_by metadata).
	By string
	// Force replays messages the loop guard refuses (replayed
	// Config.MaxReplays times already).
	Force bool
}

// ReplayResult says what a replay did, or would do (Preview).
type ReplayResult struct {
	// Replayed is the number of messages replayed.
	Replayed int64
	// Refused is the number of selected parked messages the loop guard
	// refused.
	Refused int64
	// Skipped is the number of selected rows not in state parked.
	Skipped int64
	// Destinations counts the copies per destination topic.
	Destinations map[string]int64
}

// ErrNotFound is returned by Get for an id with no row.
var ErrNotFound = errors.New("parked: no such message")

// Store is the parked-message store of one database. It is a
// settle.ParkStore. TTx is the transaction type of the driver. A Store holds
// no connection of its own and needs no Close; it is safe for concurrent use.
type Store[TTx any] struct {
	db  sqldb.Driver[TTx]
	cfg Config
}

var errTODO = errors.New("parked: not implemented yet")

// New returns the store of db configured by cfg.
func New[TTx any](db sqldb.Driver[TTx], cfg Config) (*Store[TTx], error) {
	return &Store[TTx]{db: db, cfg: cfg}, errTODO
}

// Schema returns the DDL of the store's tables and indexes.
func (s *Store[TTx]) Schema() []string { return nil }

// Check reports whether the tables exist as the store needs them: an error
// wrapping sqldb.ErrSchema (a *sqldb.SchemaError with the DDL) when not.
func (s *Store[TTx]) Check(ctx context.Context) error { return errTODO }

// Park records p (settle.ParkStore). It commits before it returns nil.
func (s *Store[TTx]) Park(ctx context.Context, p settle.Parked) error { return errTODO }

// Get returns the row id.
func (s *Store[TTx]) Get(ctx context.Context, id int64) (Message, error) { return Message{}, errTODO }

// List returns one page of the rows q selects.
func (s *Store[TTx]) List(ctx context.Context, q Query) (Page, error) { return Page{}, errTODO }

// Count returns the number of rows f selects.
func (s *Store[TTx]) Count(ctx context.Context, f Filter) (int64, error) { return 0, errTODO }

// Groups returns the failure groups with a row selected by f's Handler and
// Outcome (other fields are ignored), most recently seen first, from the
// group counts table.
func (s *Store[TTx]) Groups(ctx context.Context, f Filter) ([]Group, error) { return nil, errTODO }

// Preview returns what Replay(ctx, ob, f, opts) would do now, changing
// nothing.
func (s *Store[TTx]) Preview(ctx context.Context, f Filter, opts ReplayOptions) (ReplayResult, error) {
	return ReplayResult{}, errTODO
}

// Replay replays the parked rows f selects through ob, which must be an
// outbox of the same database: each copy is written in the transaction that
// marks its row replayed.
func (s *Store[TTx]) Replay(ctx context.Context, ob *outbox.Outbox[TTx], f Filter, opts ReplayOptions) (ReplayResult, error) {
	return ReplayResult{}, errTODO
}

// Archive marks the parked rows f selects archived and returns how many.
func (s *Store[TTx]) Archive(ctx context.Context, f Filter, by string) (int64, error) { return 0, errTODO }

// Prune deletes replayed and archived rows whose last change is before
// before. It never deletes a parked row.
func (s *Store[TTx]) Prune(ctx context.Context, before time.Time) (int64, error) { return 0, errTODO }

// Purge deletes the rows f selects whose last failure is before f.Until,
// which must be set. It deletes parked rows only when f.State is
// StateParked: a purge of parked rows is asked for by name.
func (s *Store[TTx]) Purge(ctx context.Context, f Filter) (int64, error) { return 0, errTODO }
