package parked

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/mdcolumn"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/sqldb"
)

// ident is a row's identity: the handler and the message (its UUID, or a
// hash of the payload of a message without one, as the parking middleware
// names it), hashed to a fixed 32 bytes.
func ident(handler, identity string) []byte {
	h := sha256.New()
	fmt.Fprintf(h, "%d:%s\n", len(handler), handler)
	h.Write([]byte(identity))
	return h.Sum(nil)
}

// newToken returns a fresh random token: what a statement of this
// transaction wrote, as opposed to another's.
func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// micros is t in Unix microseconds, 0 for the zero time.
func micros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}

// fromMicros is the time of us, the zero time for 0.
func fromMicros(us int64) time.Time {
	if us == 0 {
		return time.Time{}
	}
	return time.UnixMicro(us).UTC()
}

// bytesOf is s as a non-nil byte slice (a nil one would be bound as NULL).
func bytesOf(s string) []byte {
	b := make([]byte, len(s))
	copy(b, s)
	return b
}

// replaysOf is the replay count a message carries (settle_replay_count of
// a replayed copy), 0 when it has none or it is not a count.
func replaysOf(v string) int {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0
	}
	return min(n, 1<<30)
}

// Park records p (settle.ParkStore), in one transaction that writes the
// row and the counts of its failure group, and commits before it returns
// nil. It is idempotent for one handler and message (UUID; the payload for
// a message without one): parked again while its row is parked, the row
// takes the new reason, outcome, attempts, trace id and last failure (and
// moves to the new failure group if that changed), and the counts are not
// added twice; parked again once its row was replayed or archived, the row
// is left as it is (that copy of the message was dealt with). A replayed
// copy has a UUID of its own and is parked in a new row.
func (s *Store[TTx]) Park(ctx context.Context, p settle.Parked) error {
	if p.Message == nil {
		return errors.New("parked: Park: no message")
	}
	md, err := mdcolumn.Encode(p.Message.Metadata)
	if err != nil {
		return fmt.Errorf("parked: Park: metadata of message %q: %w", brief(p.Message.UUID), err)
	}
	now := time.Now()
	last := p.LastFailure
	if last.IsZero() {
		last = now
	}
	first := p.FirstFailure
	if first.After(last) {
		first = last
	}
	handler := cutRunes(clean(p.Handler), maxName)
	g := groupOf(handler, p.Outcome, p.Cause)
	reason := ""
	if p.Cause != nil {
		reason = cutBytes(clean(p.Cause.Error()), maxReason)
	}
	outcome := cutRunes(clean(string(p.Outcome)), 32)
	trace := cutRunes(clean(p.TraceID), maxTrace)
	attempts := max(p.Attempts, 0)
	payload := []byte(p.Message.Payload)
	if payload == nil {
		payload = []byte{}
	}
	id := ident(p.Handler, park.Identity(p.Message))
	row := []any{id, handler, cutRunes(clean(p.Topic), maxName), bytesOf(p.Message.UUID), bytesOf(p.Key), outcome, reason, g.id,
		attempts, micros(first), micros(last), trace, payload, md, string(StateParked),
		replaysOf(p.Message.Metadata.Get(settle.MetaReplayCount)), int64(0), "", int64(0), "", "", micros(now)}
	const tokenArg = 20 // row's token

	err = s.inTx(ctx, func(_ TTx, ex sqldb.Executor) error {
		token := newToken() // a fresh one for each run of the transaction
		row[tokenArg] = token
		var (
			rowID                    int64
			state, oldGroup, written string
			oldAttempts              int
			oldFirst, oldLast        int64
		)
		// PostgreSQL's ON CONFLICT DO NOTHING locks no row: the row it
		// found may be deleted (a prune) before find locks it. Then the
		// message has no row any more, and the insert is run again.
		for try := 1; ; try++ {
			if _, err := ex.Exec(ctx, s.q.insert, row...); err != nil {
				return err
			}
			err := ex.QueryRow(ctx, s.q.find, []any{id}, &rowID, &state, &oldGroup, &written, &oldAttempts, &oldFirst, &oldLast)
			if err == nil {
				break
			}
			if !errors.Is(err, sql.ErrNoRows) || try == 3 {
				return fmt.Errorf("reading back the row: %w", err)
			}
		}
		seen := micros(first)
		if seen == 0 {
			seen = micros(last)
		}
		if written == token {
			// This statement inserted the row.
			return s.addGroup(ctx, ex, g, handler, outcome, 1, 1, seen, micros(last))
		}
		if State(state) != StateParked {
			return nil
		}
		// Parked again: the latest failure wins, the first stays first.
		f, l := micros(first), max(micros(last), oldLast)
		if oldFirst != 0 && (f == 0 || oldFirst < f) {
			f = oldFirst
		}
		if _, err := ex.Exec(ctx, s.q.refresh, outcome, reason, g.id, max(attempts, oldAttempts), f, l, trace, micros(now), rowID); err != nil {
			return err
		}
		if oldGroup == g.id {
			return s.addGroup(ctx, ex, g, handler, outcome, 0, 0, seen, l)
		}
		if err := s.bumpGroups(ctx, ex, map[string]groupDelta{oldGroup: {parked: -1, total: -1}}); err != nil {
			return err
		}
		return s.addGroup(ctx, ex, g, handler, outcome, 1, 1, seen, l)
	})
	if err != nil {
		return fmt.Errorf("parked: Park %q of handler %q: %w", brief(p.Message.UUID), brief(handler), err)
	}
	return nil
}

// addGroup adds to the counts of g, creating its row.
func (s *Store[TTx]) addGroup(ctx context.Context, ex sqldb.Executor, g failureGroup, handler, outcome string, parked, total, first, last int64) error {
	_, err := ex.Exec(ctx, s.q.groupAdd, g.id, handler, g.errorType, g.text, outcome, parked, total, first, last)
	return err
}

// groupDelta is a change of a group's counts.
type groupDelta struct{ parked, total int64 }

// bumpGroups applies the deltas, group by group in the order of their ids
// (so that two transactions lock them in the same order), and deletes the
// groups left without a row.
func (s *Store[TTx]) bumpGroups(ctx context.Context, ex sqldb.Executor, deltas map[string]groupDelta) error {
	for _, id := range sortedKeys(deltas) {
		d := deltas[id]
		if d == (groupDelta{}) {
			continue
		}
		if _, err := ex.Exec(ctx, s.q.groupBump, d.parked, d.total, id); err != nil {
			return fmt.Errorf("counts of group %s: %w", id, err)
		}
		if d.total < 0 {
			if _, err := ex.Exec(ctx, s.q.groupDrop, id); err != nil {
				return fmt.Errorf("dropping group %s: %w", id, err)
			}
		}
	}
	return nil
}

// brief is s for an error's text: valid UTF-8, at most 128 bytes.
func brief(s string) string {
	s = clean(s)
	if c := cutBytes(s, 128); len(c) < len(s) {
		return c + "…"
	}
	return s
}
