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
