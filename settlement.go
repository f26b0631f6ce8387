package settle

import (
	"context"

	"github.com/settle-go/settle/internal/settlement"
)

// Settlement is the record of how one delivery is settling: one per
// delivery, created by the outermost of settle's middleware and written by
// each one inside it (the retry middleware sets the attempt limit, the dedupe
// middleware the durable attempt count, the parking middlewares where a copy
// went). A handler may read it; only settle's middleware write it.
type Settlement struct {
	r *settlement.Record
}

// SettlementFromContext returns the settlement of the delivery whose context
// ctx is (a handler's msg.Context()), or nil when no settle middleware runs
// around the handler.
func SettlementFromContext(ctx context.Context) *Settlement {
	r := settlement.FromContext(ctx)
	if r == nil {
		return nil
	}
	return &Settlement{r: r}
}

// Attempt returns the number of the attempt in progress: 1 for the first run
// of this handler on this message. It is 0 when no settle middleware counts
// attempts.
func (s *Settlement) Attempt() int {
	if s == nil {
		return 0
	}
	n, _, _ := s.r.Attempt()
	return n
}

// MaxAttempts returns the retry middleware's MaxAttempts: the runs of this
// handler on this message it allows in all. 0 means no retry middleware runs
// around the handler.
func (s *Settlement) MaxAttempts() int {
	if s == nil {
		return 0
	}
	n, _ := s.r.Limit()
	return n
}

// Outcome returns the outcome decided so far ("" while none is).
func (s *Settlement) Outcome() Outcome {
	if s == nil {
		return ""
	}
	o, _, _, _ := s.r.Snapshot()
	return Outcome(o)
}

// IsPermanent reports whether err, or any error it wraps, reports itself
// permanent through a Permanent() bool method that returns true (see
// poison.Permanent). settle's retry middleware does not retry such an error,
// and the poison parking middleware parks it.
func IsPermanent(err error) bool {
	for err != nil {
		if p, ok := err.(interface{ Permanent() bool }); ok && p.Permanent() {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if IsPermanent(e) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}
