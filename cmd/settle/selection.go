package main

import (
	"errors"
	"slices"
	"strings"
)

// selection says which messages of a dead-letter queue a replay takes.
// Filters combine with AND; -all takes every message and excludes filters.
type selection struct {
	ids     []string
	handler string
	reason  string
	all     bool
}

var errNoSelection = errors.New("choose messages with -id, -handler or -reason, or pass -all")

// validate refuses an empty selection (a replay must name what it takes)
// and -all combined with filters (ambiguous).
func (s selection) validate() error {
	filtered := len(s.ids) > 0 || s.handler != "" || s.reason != ""
	switch {
	case s.all && filtered:
		return errors.New("-all cannot be combined with -id, -handler or -reason")
	case !s.all && !filtered:
		return errNoSelection
	}
	return nil
}

// match reports whether e is selected. -id matches the message UUID or its
// settle_original_uuid.
func (s selection) match(e entry) bool {
	if s.all {
		return true
	}
	if len(s.ids) > 0 && !slices.Contains(s.ids, e.UUID) && (e.OriginalUUID == "" || !slices.Contains(s.ids, e.OriginalUUID)) {
		return false
	}
	if s.handler != "" && e.Handler != s.handler {
		return false
	}
	if s.reason != "" && !strings.Contains(e.Reason, s.reason) {
		return false
	}
	return true
}

// idList is a repeatable flag; each value may also hold comma-separated IDs.
type idList []string

func (l *idList) String() string { return strings.Join(*l, ",") }

func (l *idList) Set(v string) error {
	for _, id := range strings.Split(v, ",") {
		if id = strings.TrimSpace(id); id != "" {
			*l = append(*l, id)
		}
	}
	return nil
}
