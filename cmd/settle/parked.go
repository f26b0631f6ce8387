package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/jsonsize"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
)

// parkedFlags are the flags every parked command shares: where the store
// is and which rows it selects.
type parkedFlags struct {
	db, driver, table *string

	ids                                                      int64List
	handler, topic, outcome, group, state, reason, uuid, key string
	since, until                                             timeFlag
	// maxReplays is the loop guard (replay's -max-replays); 0 is the
	// store's default.
	maxReplays int
}

// register defines the flags of the store and the filters named in
// filters (a subset of "id handler topic outcome group state reason uuid
// key since until").
func (p *parkedFlags) register(fs *flag.FlagSet, filters string) {
	p.db, p.driver = dbFlag(fs), driverFlag(fs)
	p.table = fs.String("table", defaultParkedTable, "the parked-message table (parked.Config.Table)")
	for _, name := range strings.Fields(filters) {
		switch name {
		case "id":
			fs.Var(&p.ids, "id", "the row with this id; repeatable, or comma-separated")
		case "handler":
			fs.StringVar(&p.handler, "handler", "", "rows of the handler with exactly this name")
		case "topic":
			fs.StringVar(&p.topic, "topic", "", "rows consumed from exactly this topic")
		case "outcome":
			fs.StringVar(&p.outcome, "outcome", "", "rows of this outcome: dead_lettered or poisoned")
		case "group":
			fs.StringVar(&p.group, "group", "", "rows of the failure group with this id (see settle parked groups)")
		case "state":
			fs.StringVar(&p.state, "state", "", "rows in this state: parked, replayed or archived (default every state)")
		case "reason":
			fs.StringVar(&p.reason, "reason", "", "rows whose reason contains this text")
		case "uuid":
			fs.StringVar(&p.uuid, "uuid", "", "rows of the message with this UUID")
		case "key":
			fs.StringVar(&p.key, "key", "", "rows of the message with this dedupe key")
		case "since":
			fs.Var(&p.since, "since", "rows that last failed at or after this time: RFC 3339, or an age such as 2h or 7d (that long ago)")
		case "until":
			fs.Var(&p.until, "until", "rows that last failed before this time: RFC 3339, or an age such as 2h or 7d")
		default:
			panic("parked filter flag " + name)
		}
	}
}

// filter is the parked.Filter the flags select, checked.
func (p *parkedFlags) filter() (parked.Filter, error) {
	f := parked.Filter{
		IDs: p.ids, Handler: p.handler, Topic: p.topic, Group: p.group,
		Reason: p.reason, UUID: p.uuid, Key: p.key,
		Since: p.since.t, Until: p.until.t,
	}
	switch o := settle.Outcome(p.outcome); o {
	case "", settle.DeadLettered, settle.Poisoned:
		f.Outcome = o
	default:
		return f, fmt.Errorf("-outcome %q is not %s or %s", p.outcome, settle.DeadLettered, settle.Poisoned)
	}
	switch s := parked.State(p.state); s {
	case "", parked.StateParked, parked.StateReplayed, parked.StateArchived:
		f.State = s
	default:
		return f, fmt.Errorf("-state %q is not parked, replayed or archived", p.state)
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
		return f, errors.New("-since must be before -until")
	}
	return f, nil
}

// selects reports whether any filter is set: the commands that change rows
// want a selection, or -all.
func (p *parkedFlags) selects() bool {
	return len(p.ids) > 0 || p.handler != "" || p.topic != "" || p.outcome != "" || p.group != "" ||
		p.reason != "" || p.uuid != "" || p.key != "" || !p.since.t.IsZero() || !p.until.t.IsZero()
}

// open opens the database and the store, and checks the store's tables.
// The caller closes the database.
func (p *parkedFlags) open(e *env) (*database, parkedStore, error) {
	return openChecked(e, *p.db, *p.driver, "-table", func(d *database) (parkedStore, error) {
		return d.newParked(parked.Config{Table: *p.table, MaxReplays: p.maxReplays})
	})
}

// int64List is a repeatable flag of row ids; each value may hold
// comma-separated ids.
type int64List []int64

func (l *int64List) String() string {
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.FormatInt(v, 10)
	}
	return strings.Join(s, ",")
}

func (l *int64List) Set(v string) error {
	return appendPositive((*[]int64)(l), v, "a row id (a positive number)")
}

// appendPositive appends to l the comma-separated positive numbers of v, a
// value of a repeatable flag such as -id; what says what one is.
func appendPositive(l *[]int64, v, what string) error {
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil || n <= 0 {
			return fmt.Errorf("%q is not %s", f, what)
		}
		*l = append(*l, n)
	}
	return nil
}

// timeFlag is a point in time given as RFC 3339 or as an age (a duration
// ago, days allowed: 7d, 36h).
type timeFlag struct {
	t   time.Time
	raw string
}

func (f *timeFlag) String() string { return f.raw }

func (f *timeFlag) Set(v string) error {
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		f.t, f.raw = t, v
		return nil
	}
	d, err := parseAge(v)
	if err != nil || d < 0 {
		return fmt.Errorf("%q is neither an RFC 3339 time (2026-01-02T15:04:05Z) nor an age (2h, 7d)", v)
	}
	f.t, f.raw = time.Now().Add(-d), v
	return nil
}

// stamp prints a time of a row: UTC, to the second, "-" when unknown.
func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func runParkedList(e *env, args []string) (err error) {
	const name = "parked list"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "id handler topic outcome group state reason uuid key since until")
	limit := fs.Int("limit", 50, "list at most this many rows (1-1000)")
	after := fs.String("after", "", "continue after the last row of a previous page: the cursor it printed")
	asJSON := fs.Bool("json", false, `write JSON: {"messages": [...], "next": CURSOR}, without payloads`)
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	if *limit < 1 || *limit > 1000 {
		return usagef(fs, name, "-limit must be 1-1000")
	}
	f, err := p.filter()
	if err != nil {
		return usagef(fs, name, "%v", err)
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	page, err := s.List(e.ctx, parked.Query{Filter: f, Cursor: *after, Limit: *limit})
	if err != nil {
		return err
	}
	if *asJSON {
		out := struct {
			Messages []parkedJSON `json:"messages"`
			Next     string       `json:"next,omitempty"`
		}{Messages: []parkedJSON{}, Next: page.Next}
		for _, m := range page.Messages {
			out.Messages = append(out.Messages, toJSON(m, false))
		}
		return writeJSON(e.stdout, out)
	}
	if len(page.Messages) == 0 {
		fmt.Fprintln(e.stderr, "no parked message matches")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tOUTCOME\tHANDLER\tTOPIC\tUUID\tATTEMPTS\tLAST FAILURE\tREPLAYS\tREASON")
	for _, m := range page.Messages {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", m.ID, cell(string(m.State)), cell(string(m.Outcome)),
			cell(m.Handler), cell(m.Topic), cell(m.UUID), m.Attempts, stamp(m.LastFailure), m.Replays, cell(truncate(m.Reason, reasonWidth)))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if page.Next != "" {
		fmt.Fprintf(e.stdout, "next page: %s\n", nextPageCommand(fs, name, page.Next))
	}
	return nil
}

// nextPageCommand is the command line that lists the page after cursor:
// the flags given, with -after replaced. A -db URL is printed redacted
// (put the password back, or use the environment variable).
func nextPageCommand(fs *flag.FlagSet, name, cursor string) string {
	parts := []string{"settle", name}
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "after":
			return
		case "id":
			for _, id := range *f.Value.(*int64List) {
				parts = append(parts, "-id", strconv.FormatInt(id, 10))
			}
			return
		}
		v := f.Value.String()
		switch f.Name {
		case "db":
			v = redact(v)
		case "since", "until":
			// An age means another time when the next page is asked for:
			// the page goes on from the same window.
			v = f.Value.(*timeFlag).t.UTC().Format(time.RFC3339Nano)
		}
		parts = append(parts, "-"+f.Name, shellQuote(v))
	})
	parts = append(parts, "-after", shellQuote(cursor))
	return safeLine(strings.Join(parts, " "))
}

var shellPlain = regexp.MustCompile(`^[A-Za-z0-9_@%+=:,./-]+$`)

// shellQuote quotes s for a POSIX shell when it needs quoting.
func shellQuote(s string) string {
	if shellPlain.MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func runParkedShow(e *env, args []string) (err error) {
	const name = "parked show"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "")
	asJSON := fs.Bool("json", false, "write JSON: the row, its metadata and its payload (payload_base64 when it is not UTF-8)")
	pos, err := parse(e, fs, name, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef(fs, name, "want exactly one row id, got %d arguments", len(pos))
	}
	id, perr := strconv.ParseInt(pos[0], 10, 64)
	if perr != nil || id <= 0 {
		return usagef(fs, name, "%q is not a row id (a positive number; settle parked list shows them)", pos[0])
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	m, err := s.Get(e.ctx, id)
	if errors.Is(err, parked.ErrNotFound) {
		return fmt.Errorf("no row %d in %s", id, *p.table)
	}
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(e.stdout, toJSON(m, true))
	}
	return writeParked(e.stdout, m)
}

// writeParked writes one row in full, for show: its fields, its metadata,
// and its payload (indented when it is JSON, escaped when it is other text,
// a hex dump when it is not UTF-8).
func writeParked(w io.Writer, m parked.Message) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	replayed := "never"
	if m.Replays > 0 {
		replayed = fmt.Sprintf("%d times, last at %s by %s", m.Replays, stamp(m.ReplayedAt), oneLine(m.ReplayedBy))
	}
	rows := [][2]string{
		{"id", strconv.FormatInt(m.ID, 10)},
		{"state", string(m.State)},
		{"outcome", string(m.Outcome)},
		{"handler", m.Handler},
		{"topic", m.Topic},
		{"uuid", m.UUID},
		{"dedupe key", m.Key},
		{"group", m.Group},
		{"attempts", strconv.Itoa(m.Attempts)},
		{"first failure", stamp(m.FirstFailure)},
		{"last failure", stamp(m.LastFailure)},
		{"trace id", m.TraceID},
		{"replayed", replayed},
	}
	if !m.ArchivedAt.IsZero() {
		rows = append(rows, [2]string{"archived", stamp(m.ArchivedAt)})
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s:\t%s\n", r[0], cell(r[1]))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "reason:\n  %s\n", strings.ReplaceAll(safeText(m.Reason), "\n", "\n  "))
	fmt.Fprintln(w, "metadata:")
	for _, k := range slices.Sorted(maps.Keys(m.Metadata)) {
		fmt.Fprintf(w, "  %s: %s\n", oneLine(k), oneLine(m.Metadata[k]))
	}
	_, err := io.WriteString(w, payloadText(m.Payload))
	return err
}

// payloadText renders a payload for a terminal.
func payloadText(p []byte) string {
	var b bytes.Buffer
	switch {
	case len(p) > 0 && json.Valid(p):
		fmt.Fprintf(&b, "payload (%d bytes, JSON):\n", len(p))
		if jsonsize.IndentedSize(p) > max(16<<20, 8*len(p)) {
			// Nested too deep to indent: as it is.
			b.Write(p)
		} else if err := json.Indent(&b, p, "", "  "); err != nil {
			b.Write(p)
		}
		// json.Indent copies strings as they are: escape what a terminal
		// acts on.
		s := b.String()
		return safeText(s) + "\n"
	case utf8.Valid(p):
		return fmt.Sprintf("payload (%d bytes):\n%s\n", len(p), safeText(string(p)))
	}
	return fmt.Sprintf("payload (%d bytes, not UTF-8, hex):\n%s", len(p), hex.Dump(p))
}

func runParkedGroups(e *env, args []string) (err error) {
	const name = "parked groups"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "handler outcome")
	all := fs.Bool("all", false, "list groups with no parked row left too (replayed or archived only)")
	asJSON := fs.Bool("json", false, "write JSON (an array of groups)")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	f, err := p.filter()
	if err != nil {
		return usagef(fs, name, "%v", err)
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	groups, err := s.Groups(e.ctx, f)
	if err != nil {
		return err
	}
	if !*all {
		groups = slices.DeleteFunc(groups, func(g parked.Group) bool { return g.Parked == 0 })
	}
	if *asJSON {
		out := []groupJSON{}
		for _, g := range groups {
			out = append(out, groupJSON{ID: g.ID, Handler: g.Handler, Outcome: string(g.Outcome), ErrorType: g.ErrorType, Text: g.Text,
				Parked: g.Parked, Total: g.Total, FirstSeen: jsonTime(g.FirstSeen), LastSeen: jsonTime(g.LastSeen)})
		}
		return writeJSON(e.stdout, out)
	}
	if len(groups) == 0 {
		fmt.Fprintln(e.stderr, "no failure group matches")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GROUP\tHANDLER\tOUTCOME\tPARKED\tTOTAL\tFIRST SEEN\tLAST SEEN\tERROR")
	for _, g := range groups {
		what := g.Text
		if g.ErrorType != "" {
			what = g.ErrorType + ": " + g.Text
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", cell(g.ID), cell(g.Handler), cell(string(g.Outcome)),
			g.Parked, g.Total, stamp(g.FirstSeen), stamp(g.LastSeen), cell(truncate(what, reasonWidth)))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(e.stdout, "list a group's rows with: settle parked list -state parked -group GROUP")
	return nil
}

// changeFlags are the flags of the commands that change rows.
type changeFlags struct {
	all, yes bool
	by       string
}

func (c *changeFlags) register(fs *flag.FlagSet, verb string) {
	fs.BoolVar(&c.all, "all", false, "take every row (instead of a selection by filters)")
	fs.BoolVar(&c.yes, "yes", false, verb+"; without it, only print what would be done")
}

func (c *changeFlags) registerBy(fs *flag.FlagSet, e *env) {
	fs.StringVar(&c.by, "by", defaultBy(e), "who asks, recorded on each row (and on replayed copies)")
}

// defaultBy is the default of -by: $USER@host.
func defaultBy(e *env) string {
	user := e.getenv("USER")
	if user == "" {
		user = e.getenv("LOGNAME")
	}
	if user == "" {
		user = "unknown"
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		return user
	}
	return user + "@" + host
}

// parse parses the command line of a command that changes rows (p's
// filters, c's flags, and the -max-replays of replay) and returns the filter
// of the rows it names: filters or -all, not both; no positional argument.
func (c *changeFlags) parse(e *env, fs *flag.FlagSet, name string, args []string, p *parkedFlags) (parked.Filter, error) {
	pos, err := parse(e, fs, name, args)
	if err != nil {
		return parked.Filter{}, err
	}
	switch {
	case len(pos) > 0:
		return parked.Filter{}, usagef(fs, name, "unexpected argument %q (use -id to select rows)", pos[0])
	case fs.Lookup("max-replays") != nil && p.maxReplays < 1:
		return parked.Filter{}, usagef(fs, name, "-max-replays must be >= 1")
	}
	if err := c.selection(p); err != nil {
		return parked.Filter{}, usagef(fs, name, "%v", err)
	}
	f, err := p.filter()
	if err != nil {
		return parked.Filter{}, usagef(fs, name, "%v", err)
	}
	return f, nil
}

// selection checks that the command names rows: filters or -all, not both.
func (c *changeFlags) selection(p *parkedFlags) error {
	switch {
	case c.all && p.selects():
		return errors.New("-all cannot be combined with filters")
	case !c.all && !p.selects():
		return errors.New("choose rows with -id, -group, -handler, -topic, -outcome, -reason, -uuid, -key, -since or -until, or pass -all")
	}
	return nil
}

func runParkedReplay(e *env, args []string) (err error) {
	const name = "parked replay"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "id handler topic outcome group reason uuid key since until")
	var c changeFlags
	c.register(fs, "replay")
	c.registerBy(fs, e)
	ob := fs.String("outbox", defaultOutboxTopic, "write the copies through this outbox (outbox.Config.Topic), which the application's relay forwards")
	to := fs.String("to", "", "send every copy to this topic instead of the topic each message was consumed from")
	force := fs.Bool("force", false, "replay messages the loop guard refuses (replayed too often already, and failed again)")
	fs.IntVar(&p.maxReplays, "max-replays", 3, "the loop guard: refuse a message replayed this many times already (the application's parked.Config.MaxReplays)")
	f, err := c.parse(e, fs, name, args, &p)
	if err != nil {
		return err
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	o, err := d.newOutbox(outbox.Config{Topic: *ob})
	if err != nil {
		return usagef(fs, name, "-outbox: %v", err)
	}
	if err := o.Check(e.ctx); err != nil {
		return err
	}
	opts := parked.ReplayOptions{Topic: *to, By: c.by, Force: *force}
	pre, err := s.Preview(e.ctx, f, opts)
	if err != nil {
		return err
	}
	verb := "would replay"
	if c.yes {
		verb = "replaying"
	}
	writeReplaySummary(e.stdout, verb, *ob, *force, pre)
	if !c.yes {
		fmt.Fprintln(e.stdout, "dry run: nothing replayed (add -yes to replay)")
		return nil
	}
	if pre.Replayed == 0 {
		return nil
	}
	if pre.Replayed > replayProgressFrom {
		opts.Progress = replayProgress(e.stderr, pre.Replayed, time.Now)
	}
	res, err := d.replayParked(e.ctx, s, *ob, f, opts)
	if err != nil {
		return fmt.Errorf("replay (%d messages replayed before the error; run the command again to replay the rest, each message once): %w", res.Replayed, err)
	}
	fmt.Fprintf(e.stdout, "replayed %d messages into outbox %s as %s", res.Replayed, safeLine(*ob), oneLine(c.by))
	if left := pre.Replayed - res.Replayed; left > 0 {
		fmt.Fprintf(e.stdout, " (%d no longer parked when reached: replayed or archived meanwhile)", left)
	}
	fmt.Fprintf(e.stdout, "\nthe application's outbox relay forwards them; settle outbox status -topic %s shows its backlog\n", safeLine(*ob))
	return nil
}

// replayProgressFrom is the size of a replay from which the command says
// how far it is, on stderr (a replay commits 200 rows at a time).
const replayProgressFrom = 1000

// replayProgress returns a ReplayOptions.Progress that writes to w how
// many of total are replayed, at most once a second.
func replayProgress(w io.Writer, total int64, now func() time.Time) func(parked.ReplayResult) {
	var last time.Time
	return func(r parked.ReplayResult) {
		if t := now(); t.Sub(last) >= time.Second {
			last = t
			fmt.Fprintf(w, "replayed %d of %d\n", r.Replayed, total)
		}
	}
}

// writeReplaySummary says what a replay does or would do: how many, where
// to, and what it leaves.
func writeReplaySummary(w io.Writer, verb, ob string, force bool, r parked.ReplayResult) {
	fmt.Fprintf(w, "%s %d parked messages through outbox %s", verb, r.Replayed, safeLine(ob))
	if len(r.Destinations) > 0 {
		fmt.Fprintln(w, ", to:")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, dest := range slices.Sorted(maps.Keys(r.Destinations)) {
			fmt.Fprintf(tw, "  %s\t%d\n", cell(dest), r.Destinations[dest])
		}
		_ = tw.Flush()
	} else {
		fmt.Fprintln(w)
	}
	if r.Refused > 0 {
		fmt.Fprintf(w, "refused by the loop guard: %d (replayed the most times allowed and failed again; -force replays them)\n", r.Refused)
	}
	if force {
		fmt.Fprintln(w, "the loop guard is off (-force)")
	}
	if r.Skipped > 0 {
		fmt.Fprintf(w, "skipped: %d selected rows not parked (replayed or archived already)\n", r.Skipped)
	}
}

func runParkedArchive(e *env, args []string) (err error) {
	const name = "parked archive"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "id handler topic outcome group reason uuid key since until")
	var c changeFlags
	c.register(fs, "archive")
	c.registerBy(fs, e)
	f, err := c.parse(e, fs, name, args, &p)
	if err != nil {
		return err
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	cf := f
	cf.State = parked.StateParked
	n, err := s.Count(e.ctx, cf)
	if err != nil {
		return err
	}
	if !c.yes {
		fmt.Fprintf(e.stdout, "would archive %d parked messages of %s (kept for the record, never replayed)\n", n, safeLine(*p.table))
		fmt.Fprintln(e.stdout, "dry run: nothing archived (add -yes to archive)")
		return nil
	}
	n, err = s.Archive(e.ctx, f, c.by)
	if err != nil {
		return fmt.Errorf("archive (%d rows archived before the error): %w", n, err)
	}
	fmt.Fprintf(e.stdout, "archived %d parked messages of %s as %s\n", n, safeLine(*p.table), oneLine(c.by))
	return nil
}

func runParkedPurge(e *env, args []string) (err error) {
	const name = "parked purge"
	fs := newFlagSet(name)
	var p parkedFlags
	p.register(fs, "id handler topic outcome group state reason uuid key since")
	fs.Lookup("state").Usage = "delete rows in this state: parked, replayed or archived (default replayed and archived: parked rows are deleted only when named)"
	var before timeFlag
	fs.Var(&before, "before", "delete rows that last failed before this time: RFC 3339, or an age such as 30d (required)")
	yes := fs.Bool("yes", false, "delete; without it, only count what would be deleted")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	if before.t.IsZero() {
		return usagef(fs, name, "-before is required (e.g. 30d: rows that last failed more than 30 days ago)")
	}
	f, err := p.filter()
	if err != nil {
		return usagef(fs, name, "%v", err)
	}
	f.Until = before.t
	if !f.Since.IsZero() && !f.Since.Before(f.Until) {
		return usagef(fs, name, "-since must be before -before")
	}
	d, s, err := p.open(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	// What Purge deletes: the rows of the state named, or, with none named,
	// the replayed and archived ones; never a parked row unless asked.
	states := []parked.State{parked.StateReplayed, parked.StateArchived}
	what := "replayed or archived"
	if f.State != "" {
		states, what = []parked.State{f.State}, string(f.State)
	}
	var n int64
	for _, st := range states {
		cf := f
		cf.State = st
		c, err := s.Count(e.ctx, cf)
		if err != nil {
			return err
		}
		n += c
	}
	desc := fmt.Sprintf("%d %s rows from %s (last failure before %s)", n, what, safeLine(*p.table), stamp(f.Until))
	if !*yes {
		fmt.Fprintf(e.stdout, "would delete %s\n", desc)
		if f.State == "" {
			fmt.Fprintln(e.stdout, "parked rows are kept: name them with -state parked to delete them too")
		}
		fmt.Fprintln(e.stdout, "dry run: nothing deleted (add -yes to delete)")
		return nil
	}
	fmt.Fprintf(e.stdout, "deleting %s\n", desc)
	n, err = s.Purge(e.ctx, f)
	if err != nil {
		return fmt.Errorf("purge (%d rows deleted before the error): %w", n, err)
	}
	fmt.Fprintf(e.stdout, "deleted %d rows from %s\n", n, safeLine(*p.table))
	return nil
}

func runParkedSchema(e *env, args []string) error {
	const name = "parked schema"
	fs := newFlagSet(name)
	dialect := dialectFlag(fs)
	table := fs.String("table", defaultParkedTable, "the parked-message table, optionally schema-qualified (its group counts go in TABLE_groups)")
	if err := parseSchema(e, fs, name, args, dialect); err != nil {
		return err
	}
	d := schemaDatabase(*dialect)
	defer d.Close()
	s, err := d.newParked(parked.Config{Table: *table})
	if err != nil {
		return usagef(fs, name, "-table: %v", err)
	}
	schema, ok := s.(interface{ Schema() []string })
	if !ok {
		return fmt.Errorf("the parked store %T gives no schema", s)
	}
	return writeSQL(e.stdout, fmt.Sprintf("settle parked-message table %s (%s)", *table, *dialect), schema.Schema())
}

// parkedJSON is a row as list -json and show -json write it. Times are
// RFC 3339 UTC, omitted when unknown; the payload is text when it is UTF-8,
// base64 otherwise, and only in show.
type parkedJSON struct {
	ID           int64             `json:"id"`
	State        string            `json:"state"`
	Outcome      string            `json:"outcome"`
	Handler      string            `json:"handler"`
	Topic        string            `json:"topic"`
	UUID         string            `json:"uuid"`
	Key          string            `json:"dedupe_key,omitempty"`
	Group        string            `json:"group"`
	Reason       string            `json:"reason"`
	Attempts     int               `json:"attempts"`
	FirstFailure string            `json:"first_failure,omitempty"`
	LastFailure  string            `json:"last_failure,omitempty"`
	TraceID      string            `json:"trace_id,omitempty"`
	Replays      int               `json:"replays"`
	ReplayedAt   string            `json:"replayed_at,omitempty"`
	ReplayedBy   string            `json:"replayed_by,omitempty"`
	ArchivedAt   string            `json:"archived_at,omitempty"`
	Metadata     map[string]string `json:"metadata,omitempty"`
	PayloadBytes *int              `json:"payload_bytes,omitempty"`
	payloadJSON
}

// jsonTime is t for JSON: RFC 3339 UTC, "" when zero.
func jsonTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func toJSON(m parked.Message, full bool) parkedJSON {
	j := parkedJSON{ID: m.ID, State: string(m.State), Outcome: string(m.Outcome), Handler: m.Handler, Topic: m.Topic,
		UUID: m.UUID, Key: m.Key, Group: m.Group, Reason: m.Reason, Attempts: m.Attempts,
		FirstFailure: jsonTime(m.FirstFailure), LastFailure: jsonTime(m.LastFailure), TraceID: m.TraceID,
		Replays: m.Replays, ReplayedAt: jsonTime(m.ReplayedAt), ReplayedBy: m.ReplayedBy, ArchivedAt: jsonTime(m.ArchivedAt)}
	if !full {
		return j
	}
	j.Metadata = map[string]string(m.Metadata)
	n := len(m.Payload)
	j.PayloadBytes = &n
	j.payloadJSON = newPayloadJSON(m.Payload)
	return j
}

// groupJSON is a failure group as groups -json writes it.
type groupJSON struct {
	ID        string `json:"id"`
	Handler   string `json:"handler"`
	Outcome   string `json:"outcome"`
	ErrorType string `json:"error_type"`
	Text      string `json:"text"`
	Parked    int64  `json:"parked"`
	Total     int64  `json:"total"`
	FirstSeen string `json:"first_seen,omitempty"`
	LastSeen  string `json:"last_seen,omitempty"`
}
