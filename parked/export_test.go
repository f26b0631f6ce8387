package parked

import "github.com/settle-go/settle"

// Normalize is the normaliser of failure groups' texts.
var Normalize = normalize

// GroupOf returns the failure group of a park: id, error type, text.
func GroupOf(handler string, outcome settle.Outcome, cause error) (id, errorType, text string) {
	g := groupOf(handler, outcome, cause)
	return g.id, g.errorType, g.text
}

func (s *Store[TTx]) setChunk(n int) { s.chunk = n }

// SetChunk sets the most rows of one replay transaction of st, a *Store.
func SetChunk(st any, n int) { st.(interface{ setChunk(int) }).setChunk(n) }

func (s *Store[TTx]) setListScan(n int) { s.scan = n }

// SetListScan sets the most rows a bounded page of List of st, a *Store,
// reads.
func SetListScan(st any, n int) { st.(interface{ setListScan(int) }).setListScan(n) }
