package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/sqlkit"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

func runDedupePrune(e *env, args []string) (err error) {
	const name = "dedupe prune"
	fs := newFlagSet(name)
	db := dedupeFlags(fs)
	partition := partitionFlag(fs, "the table is partitioned in periods of this length (SQLConfig.Partition): the prune drops whole partitions past the cutoff, rounded down to a period")
	var pf pruneFlags
	pf.register(fs, "confirmed and released keys last touched")
	if err := pf.parse(e, fs, name, args, whyDedupeFloor); err != nil {
		return err
	}
	d, store, err := openStore(e, *db.url, *db.driver, "-table", func(d *database) (dedupeStore, error) {
		return d.newStore(dedupe.SQLConfig{Table: *db.table, Partition: *partition})
	})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	if err := store.Check(e.ctx); err != nil {
		return fmt.Errorf("prune %s: %w", *db.table, err)
	}
	cutoff := time.Now().Add(-pf.olderThan)
	at := cutoff.UTC().Format(time.RFC3339)
	n, sample, err := d.prunableKeys(e.ctx, store, cutoff)
	if err != nil {
		return fmt.Errorf("count the keys to prune in %s: %w", *db.table, err)
	}
	if *partition != 0 {
		// The partitioned table's prune keeps keys up to a period longer:
		// the dry run counts with the cutoff it uses.
		at = time.UnixMicro(cutoff.UnixMicro() / partition.Microseconds() * partition.Microseconds()).UTC().Format(time.RFC3339)
	}
	if !pf.yes {
		fmt.Fprintf(e.stdout, "would delete %d keys from %s (confirmed or released, last touched before %s)", n, *db.table, at)
		return writeDryRun(e.stdout, n > 0, []string{"KEY", "STATE", "LAST TOUCHED"}, sample)
	}
	fmt.Fprintf(e.stdout, "deleting %d keys from %s (confirmed or released, last touched before %s)\n", n, *db.table, at)
	n, err = store.Prune(e.ctx, cutoff)
	if err != nil {
		return fmt.Errorf("prune %s (%d rows removed before the error): %w", *db.table, n, err)
	}
	if *partition != 0 {
		fmt.Fprintf(e.stdout, "pruned about %d rows from %s (keys settled before %s; the rows of the partitions dropped are the database's estimate)\n", n, *db.table, at)
		return nil
	}
	fmt.Fprintf(e.stdout, "pruned %d rows from %s (keys settled before %s)\n", n, *db.table, at)
	return nil
}

// partitionFlag defines the -partition flag of the dedupe commands that
// know a partitioned claims table (SQLConfig.Partition).
func partitionFlag(fs *flag.FlagSet, usage string) *time.Duration {
	return fs.Duration("partition", 0, usage)
}

func runDedupeSchema(e *env, args []string) error {
	const name = "dedupe schema"
	fs := newFlagSet(name)
	dialect := dialectFlag(fs)
	table := fs.String("table", defaultDedupeTable, "the dedupe table, optionally schema-qualified")
	partition := partitionFlag(fs, "print the table partitioned by time in periods of this length, e.g. 24h (SQLConfig.Partition; postgres and mysql)")
	if err := parseSchema(e, fs, name, args, dialect); err != nil {
		return err
	}
	d := schemaDatabase(*dialect)
	defer d.Close()
	store, err := d.newStore(dedupe.SQLConfig{Table: *table, Partition: *partition})
	if err != nil {
		flagName := "-table"
		if *partition != 0 {
			flagName = "-partition"
		}
		return usagef(fs, name, "%s: %v", flagName, err)
	}
	stmts := store.Schema()
	header := fmt.Sprintf("settle dedupe table %s (%s)", *table, *dialect)
	if *partition != 0 {
		header = fmt.Sprintf("settle dedupe table %s (%s), partitioned in periods of %v: the store creates the partitions (SQLConfig.Partition %v)", *table, *dialect, *partition, *partition)
	}
	return writeSQL(e.stdout, header, stmts)
}

func runOutboxSchema(e *env, args []string) error {
	const name = "outbox schema"
	fs := newFlagSet(name)
	dialect := dialectFlag(fs)
	topic := fs.String("topic", defaultOutboxTopic, "the outbox topic (outbox.Config.Topic)")
	upgrade := fs.Bool("upgrade", false, "print the statements that upgrade an outbox table of an earlier settle version (see docs/outbox.md, Upgrading)")
	if err := parseSchema(e, fs, name, args, dialect); err != nil {
		return err
	}
	d := schemaDatabase(*dialect)
	defer d.Close()
	ob, err := d.newOutbox(outbox.Config{Topic: *topic})
	if err != nil {
		return usagef(fs, name, "-topic: %v", err)
	}
	if *upgrade {
		return writeSQL(e.stdout, fmt.Sprintf("settle outbox %s (%s): upgrade from a table without per-row failures", *topic, *dialect), ob.SchemaUpgrade())
	}
	return writeSQL(e.stdout, fmt.Sprintf("settle outbox %s (%s)", *topic, *dialect), ob.Schema())
}

// errOutboxUnhealthy is the error of `outbox status` when old rows are
// pending: the status was printed, the exit code says it is not well.
var errOutboxUnhealthy = errors.New("outbox is not healthy")

func runOutboxStatus(e *env, args []string) (err error) {
	const name = "outbox status"
	fs := newFlagSet(name)
	db := outboxFlags(fs)
	stuckAfter := fs.Duration("stuck-after", defaultStuckAfter, "a pending row older than this is old: with a live relay, the relay is stuck or passes it over")
	asJSON := fs.Bool("json", false, "write JSON")
	list := fs.Int("list", 10, "list up to this many rows that failed (retrying or set aside), oldest first; 0 lists none")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	switch {
	case *stuckAfter <= 0:
		return usagef(fs, name, "-stuck-after must be > 0")
	case *list < 0 || *list > 10000:
		return usagef(fs, name, "-list must be 0-10000")
	}
	d, ob, err := db.openOutbox(e, *stuckAfter)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	st, err := ob.Status(e.ctx)
	if err != nil {
		return err
	}
	var failed []outbox.FailedRow
	if *list > 0 && st.Retrying+st.SetAside > 0 {
		if failed, err = ob.Failed(e.ctx, outbox.Selection{Limit: *list}); err != nil {
			return err
		}
	}
	if *asJSON {
		err = writeJSON(e.stdout, struct {
			Topic          string          `json:"topic"`
			State          string          `json:"state"`
			Pending        int64           `json:"pending"`
			LagSeconds     float64         `json:"lag_seconds"`
			OldestOffset   int64           `json:"oldest_offset"`
			Retrying       int64           `json:"retrying"`
			SetAside       int64           `json:"set_aside"`
			LiveRelays     int64           `json:"live_relays"`
			ForwardedSince int64           `json:"forwarded_since"`
			Explain        string          `json:"explain"`
			Failed         []failedRowJSON `json:"failed"`
		}{*db.topic, string(st.State), st.Pending, st.Lag.Seconds(), st.OldestOffset, st.Retrying, st.SetAside, st.LiveRelays, st.ForwardedSince, st.Explain(), failedJSON(failed)})
	} else {
		_, err = fmt.Fprintf(e.stdout, "topic:   %s\nstate:   %s\npending: %d\nlag:     %s\nretrying:  %d\nset aside: %d\nrelays:  %d alive\n%s\n",
			*db.topic, st.State, st.Pending, st.Lag.Round(time.Millisecond), st.Retrying, st.SetAside, st.LiveRelays, outboxText(st.Explain()))
		if err == nil && len(failed) > 0 {
			if _, err = fmt.Fprintf(e.stdout, "failed rows (oldest first, at most %d; `settle outbox retry` re-queues those set aside):\n", *list); err == nil {
				err = writeFailedRows(e.stdout, failed)
			}
		}
	}
	if err != nil {
		return err
	}
	if st.State != outbox.StateOK {
		return fmt.Errorf("%w: %s", errOutboxUnhealthy, st.State)
	}
	return nil
}

func runOutboxPrune(e *env, args []string) (err error) {
	const name = "outbox prune"
	fs := newFlagSet(name)
	db := outboxFlags(fs)
	var pf pruneFlags
	pf.register(fs, "rows forwarded")
	if err := pf.parse(e, fs, name, args, whyOutboxFloor); err != nil {
		return err
	}
	d, ob, err := db.openOutbox(e, 0)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	before := time.Now().Add(-pf.olderThan)
	if err := d.outboxPrunePreview(e, ob, *db.topic, pf.olderThan, before, pf.yes); err != nil || !pf.yes {
		return err
	}
	n, err := ob.Prune(e.ctx, before)
	if err != nil {
		return fmt.Errorf("prune outbox %s (%d rows removed before the error): %w", *db.topic, n, err)
	}
	fmt.Fprintf(e.stdout, "pruned %d rows from outbox %s (forwarded more than %s ago)\n", n, *db.topic, pf.olderThan)
	return nil
}

// The defaults of -table, -topic and -stuck-after: those of
// dedupe.SQLConfig.Table, outbox.Config.Topic (TestFlagDefaultsAreTheLibrarys)
// and outbox.Config.StuckAfter, passed to the library explicitly.
const (
	defaultDedupeTable = "settle_dedupe"
	defaultOutboxTopic = "settle_outbox"
	defaultStuckAfter  = time.Minute
)

// dbFlag defines the -db flag of the commands that work on a database.
func dbFlag(fs *flag.FlagSet) *string {
	return fs.String("db", "", "database URL: postgres://, mysql:// or sqlite:///path (default $"+settleenv.PostgresURL+", else $"+settleenv.MySQLURL+")")
}

// storeFlags are the flags that name a store on a database: -db, -driver,
// and -table (dedupeFlags) or -topic (outboxFlags).
type storeFlags struct {
	url, driver  *string
	table, topic *string
}

// dedupeFlags defines the flags of the dedupe commands that read the table.
func dedupeFlags(fs *flag.FlagSet) storeFlags {
	return storeFlags{url: dbFlag(fs), driver: driverFlag(fs), table: fs.String("table", defaultDedupeTable, "the dedupe table")}
}

// outboxFlags defines the flags of the outbox commands that read the table.
func outboxFlags(fs *flag.FlagSet) storeFlags {
	return storeFlags{url: dbFlag(fs), driver: driverFlag(fs), topic: fs.String("topic", defaultOutboxTopic, "the outbox topic (outbox.Config.Topic)")}
}

// openDedupe opens the database and the dedupe store of -table, and checks
// the table. The caller closes the database.
func (f storeFlags) openDedupe(e *env) (*database, dedupeStore, error) {
	return openChecked(e, *f.url, *f.driver, "-table", dedupeTable(*f.table))
}

// openOutbox opens the database and the outbox of -topic, and checks the
// outbox's tables. The caller closes the database.
func (f storeFlags) openOutbox(e *env, stuckAfter time.Duration) (*database, outboxStore, error) {
	return openChecked(e, *f.url, *f.driver, "-topic", func(d *database) (outboxStore, error) {
		return d.newOutbox(outbox.Config{Topic: *f.topic, StuckAfter: stuckAfter})
	})
}

// parseSchema is parseFlags for a schema command, whose -dialect (dialect)
// is required and checked.
func parseSchema(e *env, fs *flag.FlagSet, name string, args []string, dialect *string) error {
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	if *dialect == "" {
		return usagef(fs, name, "-dialect is required (postgres, mysql or sqlite)")
	}
	if err := checkDialect(*dialect); err != nil {
		return usagef(fs, name, "%v", err)
	}
	return nil
}

// dialectFlag defines the -dialect flag of the schema commands (see
// parseSchema).
func dialectFlag(fs *flag.FlagSet) *string {
	return fs.String("dialect", "", "postgres, mysql or sqlite (required)")
}

// checkDialect checks a -dialect value.
func checkDialect(d string) error {
	if err := sqlkit.ValidDialect(sqldb.Dialect(d)); err != nil {
		return fmt.Errorf("-dialect: %w", err)
	}
	return nil
}

// writeSQL writes statements for migration tools: a comment header, then
// each statement with its indentation tidied, ending with ';', separated by
// blank lines.
func writeSQL(w io.Writer, header string, stmts []string) error {
	var b strings.Builder
	b.WriteString("-- " + header + "\n")
	for _, s := range stmts {
		b.WriteString("\n" + tidySQL(s) + ";\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// tidySQL trims a statement, drops its trailing ';' and re-indents its
// continuation lines: the lines inside get one tab plus their indentation
// relative to each other, a closing ')' line none.
func tidySQL(s string) string {
	s = strings.TrimSpace(s)
	s = strings.TrimSpace(strings.TrimSuffix(s, ";"))
	lines := strings.Split(s, "\n")
	indent := -1
	for _, l := range lines[1:] {
		t := strings.TrimLeft(l, " \t")
		if t == "" || strings.HasPrefix(t, ")") {
			continue
		}
		if n := len(l) - len(t); indent < 0 || n < indent {
			indent = n
		}
	}
	for i := 1; i < len(lines); i++ {
		l := strings.TrimRight(lines[i], " \t")
		t := strings.TrimLeft(l, " \t")
		switch {
		case t == "":
			lines[i] = ""
		case strings.HasPrefix(t, ")"):
			lines[i] = t
		default:
			lines[i] = "\t" + l[min(indent, len(l)-len(t)):]
		}
	}
	return strings.Join(lines, "\n")
}
