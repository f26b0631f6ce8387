package dedupe

import (
	"time"

	"github.com/settle-go/settle/internal/prunesel"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/sqldb"
)

// The settle command's dry run of a prune counts and shows the keys that
// Prune deletes, with the store's own filter (internal/prunesel).
func init() {
	prunesel.Dedupe = func(store any, before time.Time) (prunesel.Selection, bool) {
		s, ok := store.(interface {
			pruneSelection(before time.Time) prunesel.Selection
		})
		if !ok {
			return prunesel.Selection{}, false
		}
		return s.pruneSelection(before), true
	}
}

// pruneSelection is what Prune(ctx, before) deletes.
func (s *SQLStore[TTx]) pruneSelection(before time.Time) prunesel.Selection {
	if s.period != 0 {
		// A partitioned table's prune rounds the cutoff down to a partition
		// boundary; the rows of the partitions it drops are all within the
		// filter with that cutoff.
		before = time.UnixMicro(floorDiv(micros(before), s.period) * s.period)
	}
	return prunesel.Selection{Table: sqlkit.Quote(s.dialect, s.table), Where: s.q.pruneWhere, Args: s.pruneArgs(before)}
}

// pruneArgs are the arguments of the prune's filter (q.pruneWhere) for the
// cutoff before.
func (s *SQLStore[TTx]) pruneArgs(before time.Time) []any {
	cutoff := micros(before)
	switch s.dialect {
	case sqldb.Postgres:
		return []any{cutoff}
	case sqldb.MySQL:
		return []any{cutoff, cutoff}
	default:
		// A claim that has not expired yet is live whatever the cutoff says.
		return []any{cutoff, min(cutoff, micros(s.now()))}
	}
}
