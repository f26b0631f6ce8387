package outbox

import (
	"time"

	"github.com/settle-go/settle/internal/prunesel"
	"github.com/settle-go/settle/internal/sqlkit"
)

// The settle command's dry run of a prune counts and shows the rows that
// Prune deletes, with the outbox's own filter (internal/prunesel).
func init() {
	prunesel.Outbox = func(ob any, before time.Time) (prunesel.Selection, bool) {
		o, ok := ob.(interface{ core() *core })
		if !ok {
			return prunesel.Selection{}, false
		}
		c := o.core()
		return prunesel.Selection{Table: sqlkit.Quote(c.q.d, c.q.table), Where: c.q.pruneWhere, Args: []any{c.pruneAge(before)}}, true
	}
}

// core is what the outbox does whatever its driver.
func (o *Outbox[TTx]) core() *core { return o.c }
