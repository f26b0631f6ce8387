package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/settle-go/settle/dedupe"
)

func runDedupeShow(e *env, args []string) (err error) {
	const name = "dedupe show"
	fs := newFlagSet(name)
	db := dedupeFlags(fs)
	handler := fs.String("handler", "", "the handler whose key it is (its scope, dedupe.HandlerScope)")
	scope := fs.String("scope", "", "the shared scope of the key (dedupe.SharedScope's name) instead of a handler's; -scope '' for keys stored without a scope")
	key := fs.String("key", "", "the key (required): the message UUID, or what the key function returned")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	scopeSet := false
	fs.Visit(func(f *flag.Flag) { scopeSet = scopeSet || f.Name == "scope" })
	switch {
	case *key == "":
		return usagef(fs, name, "-key is required")
	case *handler != "" && scopeSet:
		return usagef(fs, name, "-handler and -scope name the same thing: give one")
	case *handler == "" && !scopeSet:
		return usagef(fs, name, "-handler is required (or -scope, for a shared scope)")
	}
	sc, whose := *handler, "handler "+*handler
	if scopeSet {
		sc, whose = *scope, fmt.Sprintf("scope %q", *scope)
		if *scope == "" {
			whose = "no scope"
		}
	}
	d, store, err := db.openDedupe(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	st, found, err := store.Lookup(e.ctx, sc, *key)
	if err != nil {
		return err
	}
	subject := fmt.Sprintf("key %s of %s", strconv.Quote(*key), whose)
	if !found {
		return fmt.Errorf("%s: no record in %s: never claimed, or pruned since (settle dedupe prune deletes settled keys)", subject, *db.table)
	}
	return writeKeyState(e.stdout, subject, st, time.Now())
}

// writeKeyState says in words what the store holds of a key: done or not,
// when, after how many attempts.
func writeKeyState(w io.Writer, subject string, st dedupe.KeyState, now time.Time) error {
	attempts := plural(st.Attempts, "attempt")
	first := ""
	if !st.FirstAttempt.IsZero() {
		first = fmt.Sprintf("; first attempt at %s (%s)", stamp(st.FirstAttempt), ago(now, st.FirstAttempt))
	}
	var line string
	switch st.State {
	case "confirmed":
		line = fmt.Sprintf("%s: done. Confirmed at %s (%s), after %s%s.", subject, stamp(st.Updated), ago(now, st.Updated), attempts, first)
	case "released":
		line = fmt.Sprintf("%s: not done. The last run failed and released the key at %s (%s), after %s%s; a redelivery runs it again.", subject, stamp(st.Updated), ago(now, st.Updated), attempts, first)
	case "refused":
		line = fmt.Sprintf("%s: not done, and not to be run. A delivery with no attempt left found the key not confirmed and refused it at %s (%s), after %s%s; the message was dead-lettered, and every delivery of the key is refused.", subject, stamp(st.Updated), ago(now, st.Updated), attempts, first)
	case "claimed":
		if st.Expires.After(now) {
			line = fmt.Sprintf("%s: running now. Claimed at %s (%s), attempt %d%s; the claim runs out at %s (in %s) unless renewed.", subject, stamp(st.Updated), ago(now, st.Updated), st.Attempts, first, stamp(st.Expires), st.Expires.Sub(now).Round(time.Second))
		} else {
			line = fmt.Sprintf("%s: not done. A claim taken at %s ran out at %s (%s) without a confirmation: its run died or overran. %s so far%s; a redelivery takes the key over.", subject, stamp(st.Updated), stamp(st.Expires), ago(now, st.Expires), capital(attempts), first)
		}
	default:
		line = fmt.Sprintf("%s: %s, %s, last changed at %s.", subject, st.State, attempts, stamp(st.Updated))
	}
	_, err := fmt.Fprintln(w, safeLine(line))
	return err
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return strconv.Itoa(n) + " " + what + "s"
}

func capital(s string) string {
	if s == "" || s[0] < 'a' || s[0] > 'z' {
		return s
	}
	return string(s[0]-'a'+'A') + s[1:]
}

// ago says how long before now t was, to the second.
func ago(now, t time.Time) string {
	d := now.Sub(t).Round(time.Second)
	if d < 0 {
		return "in " + (-d).String()
	}
	return d.String() + " ago"
}

func runDedupeInFlight(e *env, args []string) (err error) {
	const name = "dedupe inflight"
	fs := newFlagSet(name)
	db := dedupeFlags(fs)
	limit := fs.Int("limit", 50, "list at most this many claims (1-10000)")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	if *limit < 1 || *limit > 10000 {
		return usagef(fs, name, "-limit must be 1-10000")
	}
	d, store, err := db.openDedupe(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	claims, err := store.InFlight(e.ctx, *limit)
	if err != nil {
		return err
	}
	if len(claims) == 0 {
		fmt.Fprintf(e.stdout, "no claim held in %s\n", safeLine(*db.table))
		return nil
	}
	now := time.Now()
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SCOPE\tKEY\tATTEMPT\tCLAIMED\tRUNS OUT")
	for _, c := range claims {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s (%s)\t%s\n", cell(c.Scope), cell(c.Key), c.Attempts, stamp(c.Updated), ago(now, c.Updated), ago(now, c.Expires))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(claims) == *limit {
		fmt.Fprintf(e.stdout, "the %d oldest claims; -limit shows more\n", *limit)
	}
	return nil
}
