package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/settle-go/settle/dedupe"
)

// State is Status's verdict on an outbox.
type State string

const (
	// StateOK: nothing is pending, or the oldest pending row is younger than
	// Config.StuckAfter.
	StateOK State = "ok"
	// StateNoRelay: rows older than StuckAfter are pending and no relay has
	// sent a heartbeat recently. Start a relay.
	StateNoRelay State = "no_relay"
	// StateStuck: rows older than StuckAfter are pending while a relay is
	// alive, and nothing written after the oldest of them has been forwarded
	// since: the relay is not forwarding (the broker refuses, or it hangs).
	StateStuck State = "stuck"
	// StatePassedOver: rows older than StuckAfter are pending while a relay
	// is alive and forwards rows written after them: the old rows are being
	// passed over. With settle's relay that means a relay transaction holds
	// their locks without finishing (a hung publish), or the rows were
	// committed only just now by a transaction that was open for longer than
	// StuckAfter; an offset-based relay that skipped them would look the same.
	StatePassedOver State = "passed_over"
)

// Status is the backlog of an outbox and Status's verdict on it.
type Status struct {
	// Pending counts committed rows not yet forwarded.
	Pending int64
	// Lag is the age of the oldest pending row (since its INSERT), 0 when
	// none is pending.
	Lag time.Duration
	// OldestOffset is the offset of the oldest pending row, 0 when none.
	OldestOffset int64
	// LiveRelays counts relays whose heartbeat has not expired.
	LiveRelays int64
	// ForwardedSince counts rows with a higher offset than the oldest
	// pending row that were forwarded after it was written.
	ForwardedSince int64
	// State is the verdict; Explain says it in a sentence.
	State State
	// StuckAfter is the Config.StuckAfter the verdict used.
	StuckAfter time.Duration
}

// Explain says what the state means and what to do.
func (s Status) Explain() string {
	switch s.State {
	case StateNoRelay:
		return fmt.Sprintf("%d row(s) pending, the oldest for %v, and no relay is alive: start one", s.Pending, s.Lag.Round(time.Millisecond))
	case StateStuck:
		return fmt.Sprintf("%d row(s) pending, the oldest for %v, while %d relay(s) are alive and have forwarded nothing written since: the relay is stuck (is the broker refusing? see its logs)",
			s.Pending, s.Lag.Round(time.Millisecond), s.LiveRelays)
	case StatePassedOver:
		return fmt.Sprintf("row %d has been pending for %v while %d relay(s) forwarded %d row(s) written after it: it is being passed over (a relay transaction holding its lock, or a skip)",
			s.OldestOffset, s.Lag.Round(time.Millisecond), s.LiveRelays, s.ForwardedSince)
	}
	if s.Pending == 0 {
		return "nothing pending"
	}
	return fmt.Sprintf("%d row(s) pending, the oldest for %v", s.Pending, s.Lag.Round(time.Millisecond))
}

// Status reports how many committed rows are not yet forwarded, the age of
// the oldest, how many relays are alive, and a verdict: old rows pending
// with no relay, with a stuck relay, or passed over by a relay that forwards
// newer rows. It reads only; uncommitted rows are not counted.
func (o *Outbox) Status(ctx context.Context, db *sql.DB) (Status, error) {
	if db == nil {
		return Status{}, errors.New("outbox: Status: db is nil")
	}
	return o.status(ctx, sqlConn(db))
}

func (o *Outbox) status(ctx context.Context, db conn) (Status, error) {
	st := Status{StuckAfter: o.cfg.StuckAfter, State: StateOK}
	var lag float64
	if err := queryRow(ctx, db, o.q.status, nil, &st.Pending, &st.OldestOffset, &lag); err != nil {
		return Status{}, o.schemaHint(ctx, db, fmt.Errorf("outbox: status: %w", err))
	}
	if st.Pending == 0 {
		st.OldestOffset = 0
		return st, nil
	}
	if lag > 0 {
		st.Lag = time.Duration(lag * float64(time.Second))
	}
	if err := queryRow(ctx, db, o.q.live, nil, &st.LiveRelays); err != nil {
		return Status{}, o.schemaHint(ctx, db, fmt.Errorf("outbox: status: relays: %w", err))
	}
	if st.Lag < o.cfg.StuckAfter {
		return st, nil
	}
	args := []any{st.OldestOffset}
	if o.cfg.Dialect != dedupe.Postgres {
		args = append(args, st.OldestOffset)
	}
	if err := queryRow(ctx, db, o.q.statusPass, args, &st.ForwardedSince); err != nil {
		return Status{}, fmt.Errorf("outbox: status: %w", err)
	}
	switch {
	case st.LiveRelays == 0:
		st.State = StateNoRelay
	case st.ForwardedSince > 0:
		st.State = StatePassedOver
	default:
		st.State = StateStuck
	}
	return st, nil
}

// schemaHint returns err, joined with Check's error when the tables are
// missing or mis-shaped, so the caller learns what to run instead of a
// driver's "no such table".
func (o *Outbox) schemaHint(ctx context.Context, db conn, err error) error {
	if cerr := o.check(ctx, db); errors.Is(cerr, ErrSchema) {
		return cerr
	}
	return err
}
