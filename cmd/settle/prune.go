package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/settle-go/settle/internal/prunesel"
	"github.com/settle-go/settle/sqldb"
)

// pruneFloor is the shortest retention the prune commands accept without
// -force.
//
// A dedupe key is what turns a redelivered message into a duplicate: delete
// it while the message can still come back and the handler runs again, its
// effect happening twice. Messages come back long after they were handled:
// RabbitMQ redelivers an unacked delivery when its consumer's channel
// closes, which may be after the broker's consumer timeout (30 minutes by
// default); an outbox relay that was down forwards hours-old rows; an
// operator replays a dead-letter queue the next morning. The claim timeout
// (seconds) is a floor for none of these. A day covers the common ones; a
// week is the usual retention. Forwarded outbox rows are the record of what
// left the outbox; below a day there is little time to look at them when a
// consumer reports a missing message.
const pruneFloor = 24 * time.Hour

// pruneSample is how many of the rows a prune would delete it shows.
const pruneSample = 5

// pruneFlags are the flags of the prune commands.
type pruneFlags struct {
	olderThan  time.Duration
	yes, force bool
}

// register defines -older-than, -yes and -force; what is what -older-than
// removes ("rows forwarded").
func (p *pruneFlags) register(fs *flag.FlagSet, what string) {
	fs.Var((*age)(&p.olderThan), "older-than", "remove "+what+" longer ago than this, e.g. 7d or 36h (required; at least "+shortAge(pruneFloor)+" without -force)")
	fs.BoolVar(&p.yes, "yes", false, "delete; without it, only count and show what would be deleted")
	fs.BoolVar(&p.force, "force", false, fmt.Sprintf("accept an -older-than below the floor of %s", shortAge(pruneFloor)))
}

// parse is parseFlags for a prune command: -older-than is required, and
// checked against the floor (checkFloor, with why).
func (p *pruneFlags) parse(e *env, fs *flag.FlagSet, name string, args []string, why string) error {
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	if p.olderThan <= 0 {
		return usagef(fs, name, "-older-than is required and must be > 0 (e.g. 7d)")
	}
	return p.checkFloor(e, p.olderThan, why)
}

// checkFloor refuses a retention below pruneFloor unless -force is given,
// saying why; with -force it warns.
func (p pruneFlags) checkFloor(e *env, olderThan time.Duration, why string) error {
	if olderThan >= pruneFloor {
		return nil
	}
	if !p.force {
		return &usageError{msg: fmt.Sprintf("-older-than %s is below the floor of %s: %s (add -force if you are sure)",
			shortAge(olderThan), shortAge(pruneFloor), why)}
	}
	fmt.Fprintf(e.stderr, "warning: -older-than %s is below the floor of %s (-force): %s\n", shortAge(olderThan), shortAge(pruneFloor), why)
	return nil
}

// whyDedupeFloor and whyOutboxFloor say what a short retention costs.
const (
	whyDedupeFloor = "a key deleted while its message can still be redelivered (a broker redelivery after a consumer's timeout, an outbox relay catching up, a replay) lets the message run again, and its effect happens twice; keep the retention longer than the longest time a message can take to come back"
	whyOutboxFloor = "forwarded rows are the record of what left the outbox, and a short retention leaves little time to look at them when a consumer reports a missing message"
)

// shortAge prints a duration as -older-than takes it: 24h, 7d, 1m.
func shortAge(d time.Duration) string {
	if d >= 48*time.Hour && d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%dd", d/(24*time.Hour))
	}
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// pruneSelection is the selection of a prune of the library (prunesel.Dedupe or
// prunesel.Outbox) of lib, a store or an outbox, for the cutoff before.
func pruneSelection(of func(any, time.Time) (prunesel.Selection, bool), lib any, before time.Time) (prunesel.Selection, error) {
	if of == nil {
		return prunesel.Selection{}, fmt.Errorf("the library does not say what its prune deletes")
	}
	sel, ok := of(lib, before)
	if !ok {
		return prunesel.Selection{}, fmt.Errorf("the library does not say what the prune of a %T deletes", lib)
	}
	return sel, nil
}

// countSelection returns how many rows sel holds.
func (d *database) countSelection(ctx context.Context, sel prunesel.Selection) (int64, error) {
	var n int64
	err := d.pool.QueryRow(ctx, `SELECT COUNT(*) FROM `+sel.Table+` WHERE `+sel.Where, sel.Args, &n)
	return n, err
}

// sampleSelection reads columns (a select list) of the first pruneSample
// rows of sel in the order of orderBy and calls each for every row.
func (d *database) sampleSelection(ctx context.Context, sel prunesel.Selection, columns, orderBy string, each func(scan func(dest ...any) error) error) error {
	q := `SELECT ` + columns + ` FROM ` + sel.Table + ` WHERE ` + sel.Where + ` ORDER BY ` + orderBy + ` LIMIT ` + strconv.Itoa(pruneSample)
	return d.pool.Query(ctx, q, sel.Args, each)
}

// prunableKeys counts the keys of the dedupe table of store that
// store.Prune(before) would delete (confirmed or released keys last
// touched before the cutoff, and claims that expired before it) and
// returns the oldest few. The rows are those of the store's own prune
// filter (prunesel): the prune deletes what this counts, but for keys
// that writers touch in between.
func (d *database) prunableKeys(ctx context.Context, store dedupeStore, before time.Time) (int64, [][3]string, error) {
	sel, err := pruneSelection(prunesel.Dedupe, store, before)
	if err != nil {
		return 0, nil, err
	}
	n, err := d.countSelection(ctx, sel)
	if err != nil || n == 0 {
		return n, nil, err
	}
	key := "key"
	if d.dialect == sqldb.MySQL {
		key = "`key`"
	}
	var sample [][3]string
	err = d.sampleSelection(ctx, sel, key+`, state, updated_at`, `updated_at`, func(scan func(...any) error) error {
		var k []byte
		var state int
		var updated int64
		if err := scan(&k, &state, &updated); err != nil {
			return err
		}
		sample = append(sample, [3]string{safeLine(string(k)), stateName(state), time.UnixMicro(updated).UTC().Format(time.RFC3339)})
		return nil
	})
	return n, sample, err
}

func stateName(s int) string {
	switch s {
	case 0:
		return "released"
	case 1:
		return "expired claim"
	case 2:
		return "confirmed"
	case 3:
		return "refused"
	}
	return fmt.Sprint(s)
}

// writeSample writes rows under a header, indented, aligned.
// writeDryRun ends the first line of a prune's dry run: with the oldest
// rows it would delete (rows, under header) when it would delete any, then
// says that nothing was deleted.
func writeDryRun(w io.Writer, deletes bool, header []string, rows [][3]string) error {
	if deletes {
		fmt.Fprintf(w, "; the oldest:\n")
		if err := writeSample(w, header, rows); err != nil {
			return err
		}
	} else {
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w, "dry run: nothing deleted (add -yes to delete)")
	return nil
}

func writeSample(w io.Writer, header []string, rows [][3]string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  "+strings.Join(header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, "  "+strings.Join(r[:], "\t"))
	}
	return tw.Flush()
}

// outboxPrunePreview prints how many forwarded rows of the outbox topic
// ob.Prune(before) would delete and the oldest few, then, unless act,
// that nothing was deleted. The rows are those of the outbox's own prune
// filter (prunesel): rows not forwarded are never counted, as they are
// never deleted.
func (d *database) outboxPrunePreview(e *env, ob outboxStore, topic string, olderThan time.Duration, before time.Time, act bool) error {
	sel, err := pruneSelection(prunesel.Outbox, ob, before)
	if err != nil {
		return err
	}
	n, err := d.countSelection(e.ctx, sel)
	if err != nil {
		return fmt.Errorf("count the rows to prune in outbox %s: %w", topic, err)
	}
	what := fmt.Sprintf("%d rows from outbox %s (forwarded more than %s ago)", n, topic, olderThan)
	if act {
		fmt.Fprintf(e.stdout, "deleting %s\n", what)
		return nil
	}
	fmt.Fprintf(e.stdout, "would delete %s", what)
	var sample [][3]string
	if n > 0 {
		cols, order := `"uuid", "topic", "forwarded_at"::text`, `"forwarded_at"`
		switch d.dialect {
		case sqldb.MySQL:
			cols, order = "uuid, topic, CAST(forwarded_at AS CHAR)", "forwarded_at"
		case sqldb.SQLite:
			cols = `"uuid", "topic", "forwarded_at"`
		}
		err := d.sampleSelection(e.ctx, sel, cols, order, func(scan func(...any) error) error {
			var id, to, at string
			if err := scan(&id, &to, &at); err != nil {
				return err
			}
			sample = append(sample, [3]string{safeLine(id), safeLine(to), safeLine(at)})
			return nil
		})
		if err != nil {
			return fmt.Errorf("read the rows to prune in outbox %s: %w", topic, err)
		}
	}
	return writeDryRun(e.stdout, n > 0, []string{"UUID", "DESTINATION", "FORWARDED AT"}, sample)
}
