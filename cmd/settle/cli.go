package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
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
	{"dedupe schema", runDedupeSchema},
	{"outbox schema", runOutboxSchema},
	{"outbox status", runOutboxStatus},
	{"outbox prune", runOutboxPrune},
}

// synopses are the usage lines of the commands, after "settle ".
var synopses = map[string]string{
	"dlq list":      "dlq list -queue Q [-json] [-limit N]",
	"dlq show":      "dlq show -queue Q [-json] ID",
	"dlq replay":    "dlq replay -queue Q [-id ID ...] [-handler H] [-reason SUBSTR] [-all] [-to Q] [-yes]",
	"dedupe prune":  "dedupe prune -db URL [-table T] -older-than DURATION",
	"dedupe schema": "dedupe schema -dialect postgres|mysql|sqlite [-table T]",
	"outbox schema": "outbox schema -dialect postgres|mysql|sqlite [-topic T]",
	"outbox status": "outbox status -db URL [-topic T] [-stuck-after D] [-json]",
	"outbox prune":  "outbox prune -db URL [-topic T] -older-than DURATION",
}

func usage() string {
	var b strings.Builder
	b.WriteString("usage:\n")
	for _, c := range commands {
		b.WriteString("  settle " + synopses[c.name] + "\n")
	}
	b.WriteString("\n-amqp defaults to $SETTLE_AMQP_URL, -db to $SETTLE_DB_URL.\n")
	b.WriteString("Run 'settle <group> <command> -h' for the flags of a command.\n")
	return b.String()
}

// run runs the command line args (without the program name) and returns the
// exit code.
func run(args []string, stdout, stderr io.Writer) int {
	return runContext(context.Background(), args, stdout, stderr)
}

func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runEnv(&env{ctx: ctx, stdout: stdout, stderr: stderr, getenv: osGetenv}, args)
}

func runEnv(e *env, args []string) int {
	if len(args) == 0 {
		fmt.Fprint(e.stderr, usage())
		return exitUsage
	}
	if len(args) == 1 && (args[0] == "help" || args[0] == "-h" || args[0] == "-help" || args[0] == "--help") {
		fmt.Fprint(e.stdout, usage())
		return exitOK
	}
	var cmd *command
	if len(args) >= 2 {
		name := args[0] + " " + args[1]
		for i := range commands {
			if commands[i].name == name {
				cmd = &commands[i]
			}
		}
	}
	if cmd == nil {
		fmt.Fprintf(e.stderr, "settle: unknown command %q\n\n%s", strings.Join(args[:min(2, len(args))], " "), usage())
		return exitUsage
	}
	err := cmd.run(e, args[2:])
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errHelp):
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(e.stderr, "settle %s: %s\n", cmd.name, ue.msg)
		if ue.usage != "" {
			fmt.Fprint(e.stderr, ue.usage)
		}
		return exitUsage
	default:
		fmt.Fprintf(e.stderr, "settle: %v\n", err)
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

func usagef(fs *flag.FlagSet, name, format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...), usage: flagUsage(fs, name)}
}
