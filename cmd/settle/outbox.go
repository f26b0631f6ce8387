package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/settle-go/settle/outbox"
)

// The outbox's rows that failed: listed by `outbox status`, put back by
// `outbox retry`.

// failedRowJSON is a failed row in -json output.
type failedRowJSON struct {
	Offset        int64      `json:"offset"`
	UUID          string     `json:"uuid"`
	Topic         string     `json:"topic"`
	Bytes         int64      `json:"bytes"`
	Attempts      int        `json:"attempts"`
	LastError     string     `json:"last_error"`
	CreatedAt     time.Time  `json:"created_at"`
	SetAside      bool       `json:"set_aside"`
	SetAsideAt    *time.Time `json:"set_aside_at,omitempty"`
	NextAttemptAt *time.Time `json:"next_attempt_at,omitempty"`
}

func failedJSON(rows []outbox.FailedRow) []failedRowJSON {
	out := make([]failedRowJSON, 0, len(rows))
	for _, f := range rows {
		j := failedRowJSON{Offset: f.Offset, UUID: f.UUID, Topic: f.Topic, Bytes: f.Bytes, Attempts: f.Attempts,
			LastError: f.LastError, CreatedAt: f.CreatedAt, SetAside: !f.SetAsideAt.IsZero()}
		if !f.SetAsideAt.IsZero() {
			j.SetAsideAt = &f.SetAsideAt
		} else if !f.NextAttemptAt.IsZero() {
			j.NextAttemptAt = &f.NextAttemptAt
		}
		out = append(out, j)
	}
	return out
}

// writeFailedRows prints rows for a terminal, one block per row, every
// value from the table escaped.
func writeFailedRows(w io.Writer, rows []outbox.FailedRow) error {
	var b strings.Builder
	for _, f := range rows {
		state := "retrying, next attempt " + f.NextAttemptAt.Format(time.RFC3339)
		if !f.SetAsideAt.IsZero() {
			state = "set aside " + f.SetAsideAt.Format(time.RFC3339)
		}
		fmt.Fprintf(&b, "  offset %d  %s  attempts %d  %d bytes\n      topic %s  uuid %s\n      last error: %s\n",
			f.Offset, state, f.Attempts, f.Bytes, outboxText(f.Topic), outboxText(f.UUID), outboxText(f.LastError))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// outboxText escapes what a terminal would interpret: C0 and C1 control
// characters, DEL and invalid UTF-8 are written as Go escapes.
func outboxText(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\\':
			b.WriteString(`\\`)
		case unicode.IsControl(r) || r == '\u2028' || r == '\u2029':
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// offsetList is a repeatable -offset flag; each value may hold
// comma-separated offsets.
type offsetList []int64

func (l *offsetList) String() string { return (*int64List)(l).String() }

func (l *offsetList) Set(v string) error {
	return appendPositive((*[]int64)(l), v, "a row offset (a positive integer)")
}

func runOutboxRetry(e *env, args []string) (err error) {
	const name = "outbox retry"
	fs := newFlagSet(name)
	db := outboxFlags(fs)
	var offsets offsetList
	fs.Var(&offsets, "offset", "re-queue the set-aside row with this offset (repeatable, or comma-separated)")
	dest := fs.String("dest", "", "re-queue the set-aside rows to this destination topic")
	all := fs.Bool("all", false, "re-queue every set-aside row (when neither -offset nor -dest is given)")
	yes := fs.Bool("yes", false, "re-queue them; without it, only show what would be re-queued")
	asJSON := fs.Bool("json", false, "write JSON")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	switch {
	case len(offsets) == 0 && *dest == "" && !*all:
		return usagef(fs, name, "say which set-aside rows to re-queue: -offset N, -dest TOPIC, or -all")
	case len(offsets) > maxOffsets:
		return usagef(fs, name, "-offset names %d rows, at most %d at a time", len(offsets), maxOffsets)
	}
	d, ob, err := db.openOutbox(e, 0)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	sel := outbox.Selection{Offsets: offsets, Topic: *dest, SetAsideOnly: true, Limit: 10000}
	rows, err := ob.Failed(e.ctx, sel)
	if err != nil {
		return err
	}
	var requeued int64
	if *yes {
		// Exactly the rows read (and shown by the dry run), by offset: a
		// selection of more rows than one read takes is re-queued a read's
		// worth at a time, never more than was shown.
		for i := 0; i < len(rows); i += maxOffsets {
			chunk := rows[i:min(i+maxOffsets, len(rows))]
			offs := make([]int64, len(chunk))
			for j, r := range chunk {
				offs[j] = r.Offset
			}
			n, err := ob.Requeue(e.ctx, outbox.Selection{Offsets: offs, Topic: *dest})
			requeued += n
			if err != nil {
				return fmt.Errorf("re-queue (%d row(s) re-queued before the error): %w", requeued, err)
			}
		}
	}
	if *asJSON {
		return writeJSON(e.stdout, struct {
			Topic    string          `json:"topic"`
			DryRun   bool            `json:"dry_run"`
			Rows     []failedRowJSON `json:"rows"`
			Requeued int64           `json:"requeued"`
		}{*db.topic, !*yes, failedJSON(rows), requeued})
	}
	if len(rows) == 0 {
		_, err = fmt.Fprintf(e.stdout, "no set-aside row of outbox %s matches\n", *db.topic)
		return err
	}
	if err := writeFailedRows(e.stdout, rows); err != nil {
		return err
	}
	if len(rows) == sel.Limit {
		fmt.Fprintf(e.stderr, "note: at most %d rows are read at a time; more may be set aside (run the command again after this one)\n", sel.Limit)
	}
	if !*yes {
		_, err = fmt.Fprintf(e.stdout, "dry run: %d set-aside row(s) of outbox %s would be re-queued; run again with -yes to re-queue them\n", len(rows), *db.topic)
		return err
	}
	_, err = fmt.Fprintf(e.stdout, "re-queued %d row(s) of outbox %s: relays forward them at their next batch, with a fresh count of attempts\n", requeued, *db.topic)
	return err
}

// maxOffsets is the most offsets one outbox.Selection may name.
const maxOffsets = 1000
