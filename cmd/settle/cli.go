package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // the command ran and failed
	exitUsage = 2 // the command line is wrong
)

// usageError is a wrong command line: the message is printed with the usage
// of the command and the exit code is 2.
type usageError struct {
	msg   string
	usage string
}

func (e *usageError) Error() string { return e.msg }

// errHelp asks for the usage to be printed with exit code 0.
var errHelp = errors.New("help requested")

// env holds what a command writes to and reads from its environment.
type env struct {
	ctx    context.Context
	stdout io.Writer
	stderr io.Writer
	getenv func(string) string
}

// command is one leaf of the command tree.
type command struct {
	name string // "dlq list"
	run  func(e *env, args []string) error
}

// commands in the order of the usage text.
var commands = []command{
	{"dlq list", runDLQList},
	{"dlq show", runDLQShow},
	{"dlq replay", runDLQReplay},
	{"dedupe prune", runDedupePrune},
	{"dedupe show", runDedupeShow},
	{"dedupe inflight", runDedupeInFlight},
	{"dedupe schema", runDedupeSchema},
	{"outbox schema", runOutboxSchema},
	{"outbox status", runOutboxStatus},
	{"outbox prune", runOutboxPrune},
	{"outbox retry", runOutboxRetry},
	{"parked list", runParkedList},
	{"parked show", runParkedShow},
	{"parked groups", runParkedGroups},
	{"parked replay", runParkedReplay},
	{"parked archive", runParkedArchive},
	{"parked purge", runParkedPurge},
	{"parked schema", runParkedSchema},
	{"trace", runTrace},
	{"console", runConsole},
}

// synopses are the usage lines of the commands, after "settle ".
var synopses = map[string]string{
	"dlq list":        "dlq list -queue Q [-json] [-limit N] [-force]",
	"dlq show":        "dlq show -queue Q [-json] [-force] ID",
	"dlq replay":      "dlq replay -queue Q [-id ID ...] [-handler H] [-reason SUBSTR] [-all] [-to Q | -allow-topics T,... | -any-destination] [-force] [-yes]",
	"dedupe prune":    "dedupe prune -db URL [-driver pgx|sql] [-table T] [-partition 24h] -older-than AGE [-force] [-yes]",
	"dedupe show":     "dedupe show -db URL [-driver pgx|sql] [-table T] (-handler H | -scope S) -key KEY",
	"dedupe inflight": "dedupe inflight -db URL [-driver pgx|sql] [-table T] [-limit N]",
	"dedupe schema":   "dedupe schema -dialect postgres|mysql|sqlite [-table T] [-partition 24h]",
	"outbox schema":   "outbox schema -dialect postgres|mysql|sqlite [-topic T] [-upgrade]",
	"outbox status":   "outbox status -db URL [-driver pgx|sql] [-topic T] [-stuck-after D] [-list N] [-json]",
	"outbox retry":    "outbox retry -db URL [-driver pgx|sql] [-topic T] (-offset N ... | -dest TOPIC | -all) [-yes] [-json]",
	"outbox prune":    "outbox prune -db URL [-driver pgx|sql] [-topic T] -older-than AGE [-force] [-yes]",
	"parked list":     "parked list -db URL [-driver pgx|sql] [-table T] [FILTERS] [-limit N] [-after CURSOR] [-json]",
	"parked show":     "parked show -db URL [-driver pgx|sql] [-table T] [-json] ID",
	"parked groups":   "parked groups -db URL [-driver pgx|sql] [-table T] [-handler H] [-outcome O] [-all] [-json]",
	"parked replay":   "parked replay -db URL [-driver pgx|sql] [-table T] (FILTERS | -all) [-outbox T] [-to TOPIC] [-force] [-max-replays N] [-by WHO] [-yes]",
	"parked archive":  "parked archive -db URL [-driver pgx|sql] [-table T] (FILTERS | -all) [-by WHO] [-yes]",
	"parked purge":    "parked purge -db URL [-driver pgx|sql] [-table T] [FILTERS] [-state S] -before TIME [-yes]",
	"parked schema":   "parked schema -dialect postgres|mysql|sqlite [-table T]",
	"trace":           "trace [-jaeger URL] (-id TRACE | -service S [-message UUID | -tag KEY=VALUE]) [-svg FILE]",
	"console":         "console -db URL [-driver pgx|sql] [-addr 127.0.0.1:8080] [-token-file F] [-read-only] [-jaeger URL] [-table T] [-topic T] [-dedupe-table T]",
}

// parkedFiltersHelp says what FILTERS stands for in the synopses of the
// parked commands.
const parkedFiltersHelp = `FILTERS (of the parked commands; combined with AND): -id N[,N...] -handler H -topic T
  -outcome dead_lettered|poisoned -group G -state parked|replayed|archived -reason TEXT
  -uuid U -key K -since TIME -until TIME, where TIME is RFC 3339 or an age (2h, 7d)
`

// usage is the usage of every command, or of those of one group ("dlq")
// when group is not empty.
func usage(group ...string) string {
	var b strings.Builder
	b.WriteString("usage:\n")
	for _, c := range commands {
		if len(group) == 0 || strings.HasPrefix(c.name, group[0]+" ") {
			b.WriteString("  settle " + synopses[c.name] + "\n")
		}
	}
	if len(group) == 0 || group[0] == "parked" {
		b.WriteString("\n" + parkedFiltersHelp)
	}
	b.WriteString("\n" + envHelp + "\n")
	b.WriteString("Run 'settle <command> -h' for the flags of a command, 'settle <group> --help' for the commands of a group.\n")
	return b.String()
}

// isGroup reports whether name is the first word of some command.
func isGroup(name string) bool {
	for _, c := range commands {
		if strings.HasPrefix(c.name, name+" ") {
			return true
		}
	}
	return false
}

func isHelp(arg string) bool {
	switch arg {
	case "help", "-h", "-help", "--help":
		return true
	}
	return false
}

func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runEnv(&env{ctx: ctx, stdout: stdout, stderr: stderr, getenv: osGetenv}, args)
}

func runEnv(e *env, args []string) int {
	// No control character reaches the terminal, whoever printed it.
	e.stdout, e.stderr = controlFilter{e.stdout}, controlFilter{e.stderr}
	if len(args) == 0 {
		fmt.Fprint(e.stderr, usage())
		return exitUsage
	}
	if len(args) == 1 && isHelp(args[0]) {
		fmt.Fprint(e.stdout, usage())
		return exitOK
	}
	if isGroup(args[0]) {
		// "settle dlq --help" and "settle help dlq" show the group's commands;
		// "settle dlq" alone shows them as a usage error.
		if len(args) == 2 && isHelp(args[1]) {
			fmt.Fprint(e.stdout, usage(args[0]))
			return exitOK
		}
		if len(args) == 1 {
			fmt.Fprintf(e.stderr, "settle %s: which command?\n\n%s", args[0], usage(args[0]))
			return exitUsage
		}
	}
	if len(args) == 2 && args[0] == "help" && isGroup(args[1]) {
		fmt.Fprint(e.stdout, usage(args[1]))
		return exitOK
	}
	var cmd *command
	rest := args
	for i := range commands {
		switch n := commands[i].name; {
		case n == args[0]:
			cmd, rest = &commands[i], args[1:]
		case len(args) >= 2 && n == args[0]+" "+args[1]:
			cmd, rest = &commands[i], args[2:]
		}
	}
	if cmd == nil {
		fmt.Fprintf(e.stderr, "settle: unknown command %q\n\n%s", strings.Join(args[:min(2, len(args))], " "), usage())
		return exitUsage
	}
	err := cmd.run(e, rest)
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errHelp):
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(e.stderr, "settle %s: %s\n", cmd.name, safeText(ue.msg))
		if ue.usage != "" {
			fmt.Fprint(e.stderr, ue.usage)
		} else {
			fmt.Fprintf(e.stderr, "usage: settle %s\nRun 'settle %s -h' for its flags.\n", synopses[cmd.name], cmd.name)
		}
		return exitUsage
	default:
		// An error may quote what a broker, a database or Jaeger sent.
		fmt.Fprintf(e.stderr, "settle: %s\n", safeText(err.Error()))
		return exitFail
	}
}

// newFlagSet returns a flag set for cmd that reports errors instead of
// exiting; its usage text goes into the usageError.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("settle "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// flagUsage renders the synopsis and flags of a command.
func flagUsage(fs *flag.FlagSet, name string) string {
	var b strings.Builder
	b.WriteString("usage: settle " + synopses[name] + "\n")
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
	return b.String()
}

// parse parses args into fs, allowing flags after positional arguments
// ("show ID -queue Q"), and returns the positional arguments. -h prints the
// usage to stdout and returns errHelp.
func parse(e *env, fs *flag.FlagSet, name string, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fmt.Fprint(e.stdout, flagUsage(fs, name))
				return nil, errHelp
			}
			return nil, &usageError{msg: err.Error(), usage: flagUsage(fs, name)}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if rest[0] == "--" {
			return append(pos, rest[1:]...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// parseFlags is parse for a command that takes no positional argument: one
// is a usage error.
func parseFlags(e *env, fs *flag.FlagSet, name string, args []string) error {
	pos, err := parse(e, fs, name, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef(fs, name, "unexpected argument %q", pos[0])
	}
	return nil
}

func usagef(fs *flag.FlagSet, name, format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...), usage: flagUsage(fs, name)}
}

// age is a duration flag that also takes days, as retentions are usually
// said: "7d", "1d12h", or anything time.ParseDuration takes ("168h").
type age time.Duration

func (a *age) String() string { return time.Duration(*a).String() }

func (a *age) Set(v string) error {
	d, err := parseAge(v)
	if err != nil {
		return err
	}
	*a = age(d)
	return nil
}

func parseAge(v string) (time.Duration, error) {
	days, rest, ok := strings.Cut(v, "d")
	if !ok {
		return time.ParseDuration(v)
	}
	n, err := strconv.Atoi(days)
	if err != nil || n < 0 || n > 100*365 {
		return 0, fmt.Errorf("%q: want a number of days before the d, like 7d or 1d12h", v)
	}
	d := time.Duration(n) * 24 * time.Hour
	if rest != "" {
		r, err := time.ParseDuration(rest)
		if err != nil || r < 0 {
			return 0, fmt.Errorf("%q: after the days, want a duration like 12h", v)
		}
		d += r
	}
	return d, nil
}
