package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/settle-go/settle/sqldb"
)

// State is Status's verdict on an outbox.
type State string

const (
	// StateOK: nothing is pending, or the oldest pending row is younger than
	// Config.StuckAfter, and no row is set aside.
	StateOK State = "ok"
	// StateNoRelay: rows older than StuckAfter are pending and no relay has
	// sent a heartbeat recently. Start a relay.
	StateNoRelay State = "no_relay"
	// StateStuck: rows older than StuckAfter are pending while a relay is
	// alive, and nothing written after the oldest of them has been forwarded
	// since: the relay is not forwarding (the broker refuses, or it hangs).
	StateStuck State = "stuck"
	// StatePassedOver: rows older than StuckAfter are pending while a relay
	// is alive and forwards rows written after them, and the oldest does
	// not wait for a next attempt: the old rows are being passed over. With settle's relay
	// that means a relay transaction holds their locks without finishing (a
	// hung publish), or the rows were committed only just now by a
	// transaction that was open for longer than StuckAfter; an offset-based
	// relay that skipped them would look the same.
	StatePassedOver State = "passed_over"
	// StateRetrying: the oldest pending row is older than StuckAfter, its
	// publish has failed (Status.OldestAttempts, OldestError) and it waits
	// for its next attempt, while a relay forwards rows written after it:
	// the broker refuses this row.
	// The relay retries it with backoff and sets it aside after
	// RelayConfig.MaxAttempts.
	StateRetrying State = "retrying"
	// StateSetAside: nothing else is wrong, but rows have been set aside
	// after repeated failures (Status.SetAside): they wait for a person.
	// List them with Failed (`settle outbox status`), fix the cause, and
	// put them back with Requeue (`settle outbox retry`).
	StateSetAside State = "set_aside"
)

// Status is the backlog of an outbox and Status's verdict on it.
type Status struct {
	// Pending counts committed rows not yet forwarded, rows waiting for
	// their next attempt included, rows set aside not.
	Pending int64
	// Lag is the age of the oldest pending row (since its INSERT), 0 when
	// none is pending.
	Lag time.Duration
	// OldestOffset is the offset of the oldest pending row, 0 when none.
	OldestOffset int64
	// Retrying counts pending rows whose publish has failed at least once.
	Retrying int64
	// SetAside counts rows set aside after repeated failures: never
	// forwarded, never pruned, until Requeue.
	SetAside int64
	// OldestAttempts and OldestError are the failed publishes and the last
	// error of the oldest pending row, when it is older than StuckAfter.
	OldestAttempts int
	OldestError    string
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
	aside := ""
	if s.SetAside > 0 && s.State != StateSetAside {
		aside = fmt.Sprintf("; %d row(s) set aside", s.SetAside)
	}
	lastErr := ""
	if s.OldestAttempts > 0 {
		lastErr = fmt.Sprintf(" (it failed %d time(s), last: %s)", s.OldestAttempts, s.OldestError)
	}
	switch s.State {
	case StateNoRelay:
		return fmt.Sprintf("%d row(s) pending, the oldest for %v, and no relay is alive: start one%s", s.Pending, s.Lag.Round(time.Millisecond), aside)
	case StateStuck:
		return fmt.Sprintf("%d row(s) pending, the oldest for %v%s, while %d relay(s) are alive and have forwarded nothing written since: the relay is stuck (is the broker refusing? see its logs)%s",
			s.Pending, s.Lag.Round(time.Millisecond), lastErr, s.LiveRelays, aside)
	case StatePassedOver:
		return fmt.Sprintf("row %d has been pending for %v while %d relay(s) forwarded %d row(s) written after it: it is being passed over (a relay transaction holding its lock, or a skip)%s",
			s.OldestOffset, s.Lag.Round(time.Millisecond), s.LiveRelays, s.ForwardedSince, aside)
	case StateRetrying:
		return fmt.Sprintf("row %d has been pending for %v%s while %d relay(s) forwarded %d row(s) written after it: the broker refuses it; it is retried with backoff and set aside after the relay's MaxAttempts%s",
			s.OldestOffset, s.Lag.Round(time.Millisecond), lastErr, s.LiveRelays, s.ForwardedSince, aside)
	case StateSetAside:
		return fmt.Sprintf("%d row(s) set aside after repeated failures: see them with `settle outbox status`, fix the cause, re-queue them with `settle outbox retry`; %d row(s) pending", s.SetAside, s.Pending)
	}
	if s.Pending == 0 {
		return "nothing pending"
	}
	return fmt.Sprintf("%d row(s) pending, the oldest for %v", s.Pending, s.Lag.Round(time.Millisecond))
}

// Status reports how many committed rows are not yet forwarded, the age of
// the oldest, how many are retrying and set aside, how many relays are
// alive, and a verdict: old rows pending with no relay, with a stuck relay,
// refused by the broker, or passed over by a relay that forwards newer
// rows; or rows set aside. It reads only; uncommitted rows are not counted.
func (o *Outbox[TTx]) Status(ctx context.Context) (Status, error) { return o.c.status(ctx) }

func (o *core) status(ctx context.Context) (Status, error) {
	db := o.db.DB()
	st := Status{StuckAfter: o.cfg.StuckAfter, State: StateOK}
	var lag float64
	if err := db.QueryRow(ctx, o.q.status, nil, &st.Pending, &st.OldestOffset, &lag, &st.Retrying); err != nil {
		return Status{}, o.schemaHint(ctx, fmt.Errorf("outbox: status: %w", err))
	}
	if err := db.QueryRow(ctx, o.q.aside, nil, &st.SetAside); err != nil {
		return Status{}, o.schemaHint(ctx, fmt.Errorf("outbox: status: set aside: %w", err))
	}
	// Relays are counted whatever the backlog: "0 alive" must mean it.
	if err := db.QueryRow(ctx, o.q.live, nil, &st.LiveRelays); err != nil {
		return Status{}, o.schemaHint(ctx, fmt.Errorf("outbox: status: relays: %w", err))
	}
	if st.SetAside > 0 {
		st.State = StateSetAside
	}
	if st.Pending == 0 {
		st.OldestOffset = 0
		return st, nil
	}
	if lag > 0 {
		st.Lag = time.Duration(lag * float64(time.Second))
	}
	if st.Lag < o.cfg.StuckAfter {
		return st, nil
	}
	args := []any{st.OldestOffset}
	if o.q.d != sqldb.Postgres {
		args = append(args, st.OldestOffset)
	}
	if err := db.QueryRow(ctx, o.q.statusPass, args, &st.ForwardedSince); err != nil {
		return Status{}, fmt.Errorf("outbox: status: %w", err)
	}
	var waiting int
	switch err := db.QueryRow(ctx, o.q.statusHead, []any{st.OldestOffset}, &st.OldestAttempts, &st.OldestError, &waiting); {
	case errors.Is(err, sql.ErrNoRows): // forwarded meanwhile
	case err != nil:
		return Status{}, fmt.Errorf("outbox: status: %w", err)
	}
	switch {
	case st.LiveRelays == 0:
		st.State = StateNoRelay
	case st.ForwardedSince > 0 && waiting == 1:
		st.State = StateRetrying
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
func (o *core) schemaHint(ctx context.Context, err error) error {
	if cerr := o.check(ctx); errors.Is(cerr, sqldb.ErrSchema) {
		return cerr
	}
	return err
}
