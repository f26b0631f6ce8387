// Package prunesel hands the selection of a prune, the rows that
// dedupe.SQLStore.Prune and outbox.Outbox.Prune delete, to the settle
// command, whose dry run counts and shows those rows before anything is
// deleted. The selection is the library's own, read from the store or the
// outbox that will delete: the dry run cannot show other rows than the
// prune deletes, and a change to a prune's filter changes both.
//
// dedupe and outbox set Dedupe and Outbox when they are initialised; the
// selection is not part of their API.
package prunesel

import "time"

// Selection is what a prune with one cutoff deletes: the rows of Table
// where Where holds, with Args bound to Where's placeholders (written in
// the dialect's style, numbered from 1 where the dialect numbers them).
// The prune deletes them in batches; the rows that a concurrent writer
// changes meanwhile are re-checked under their lock.
type Selection struct {
	Table string // quoted
	Where string
	Args  []any
}

// Dedupe returns the selection of store.Prune(ctx, before), for a
// *dedupe.SQLStore of any driver; ok is false for anything else. Set by
// package dedupe.
var Dedupe func(store any, before time.Time) (sel Selection, ok bool)

// Outbox returns the selection of ob.Prune(ctx, before), for an
// *outbox.Outbox of any driver; ok is false for anything else. Set by
// package outbox.
var Outbox func(ob any, before time.Time) (sel Selection, ok bool)
