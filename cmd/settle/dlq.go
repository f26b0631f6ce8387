package main

import (
	"errors"
	"fmt"
	"time"
)

const defaultListLimit = 1000

func runDLQList(e *env, args []string) (err error) {
	const name = "dlq list"
	fs := newFlagSet(name)
	var f amqpFlags
	f.register(fs)
	asJSON := fs.Bool("json", false, "write JSON (an array of objects) instead of a table")
	limit := fs.Int("limit", defaultListLimit, "list at most this many messages; 0 lists all (each is held in memory until the end)")
	pos, err := f.parse(e, fs, name, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) > 0:
		return usagef(fs, name, "unexpected argument %q", pos[0])
	case *limit < 0:
		return usagef(fs, name, "-limit must be >= 0")
	}

	s, err := openDLQ(e, f)
	if err != nil {
		return err
	}
	entries, err := collect(e, s, *limit, func(entry) bool { return true })
	if cerr := s.close(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	if err != nil {
		return err
	}
	if len(entries) == 0 {
		fmt.Fprintf(e.stderr, "queue %q is empty\n", f.queue)
	} else if len(entries) < s.depth {
		fmt.Fprintf(e.stderr, "showing the first %d of %d messages on %s (-limit 0 lists all)\n", len(entries), s.depth, safeLine(f.queue))
	}
	if *asJSON {
		views := make([]entry, len(entries))
		for i, en := range entries {
			views[i] = en.listView()
		}
		return writeJSON(e.stdout, views)
	}
	if len(entries) == 0 {
		return nil
	}
	return writeTable(e.stdout, entries)
}

func runDLQShow(e *env, args []string) error {
	const name = "dlq show"
	fs := newFlagSet(name)
	var f amqpFlags
	f.register(fs)
	asJSON := fs.Bool("json", false, "write JSON (an array of the matching messages)")
	pos, err := f.parse(e, fs, name, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef(fs, name, "want exactly one message UUID, got %d arguments", len(pos))
	}
	id := pos[0]
	match := func(en entry) bool { return en.UUID == id || en.OriginalUUID == id }

	s, err := openDLQ(e, f)
	if err != nil {
		return err
	}
	if s.depth == 0 {
		_ = s.close()
		return fmt.Errorf("queue %q is empty", f.queue)
	}
	found, err := collect(e, s, 0, match)
	if cerr := s.close(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	if err != nil {
		return err
	}
	if len(found) == 0 {
		return fmt.Errorf("no message %q on queue %s (%d examined)", id, f.queue, s.depth)
	}
	if *asJSON {
		return writeJSON(e.stdout, found)
	}
	for i, en := range found {
		if i > 0 {
			fmt.Fprintln(e.stdout)
		}
		if err := writeDetail(e.stdout, en); err != nil {
			return err
		}
	}
	return nil
}

// collect gets up to limit messages (0: every message ready when the session
// started) and returns those that keep selects. It holds all of them:
// close returns them to the queue.
func collect(e *env, s *dlqSession, limit int, keep func(entry) bool) ([]entry, error) {
	bound := s.depth
	if limit > 0 {
		bound = min(bound, limit)
	}
	p := newProgress(e.stderr, time.Second)
	var out []entry
	for i := 0; i < bound; i++ {
		if err := e.ctx.Err(); err != nil {
			return out, err
		}
		_, en, ok, err := s.next()
		if err != nil {
			return out, err
		}
		if !ok {
			break
		}
		if keep(en) {
			out = append(out, en)
		}
		p.tick("%s: read %d of %d messages", s.queue, i+1, bound)
	}
	return out, nil
}
