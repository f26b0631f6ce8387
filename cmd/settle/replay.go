package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

func runDLQReplay(e *env, args []string) (err error) {
	const name = "dlq replay"
	fs := newFlagSet(name)
	var f amqpFlags
	f.register(fs)
	var sel selection
	fs.Var((*idList)(&sel.ids), "id", "replay the message with this UUID (or settle_original_uuid); repeatable, or comma-separated")
	fs.StringVar(&sel.handler, "handler", "", "replay the messages whose settle_handler is exactly this")
	fs.StringVar(&sel.reason, "reason", "", "replay the messages whose settle_reason contains this")
	fs.BoolVar(&sel.all, "all", false, "replay every message on the queue")
	to := fs.String("to", "", "publish to this queue instead of each message's settle_original_topic")
	var allow idList
	fs.Var(&allow, "allow-topics", "replay only to these destinations (settle_original_topic); repeatable, or comma-separated")
	anyDest := fs.Bool("any-destination", false, "replay to whatever destinations the messages name, however many")
	yes := fs.Bool("yes", false, "act; without it, only print what would be done")
	limit := fs.Int("limit", 0, "examine at most this many messages; 0 examines every message ready at the start")
	every := fs.Duration("progress", time.Second, "print a progress line to stderr at most this often; 0 for none")
	pos, err := f.parse(e, fs, name, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) > 0:
		return usagef(fs, name, "unexpected argument %q (use -id to select messages)", pos[0])
	case *limit < 0:
		return usagef(fs, name, "-limit must be >= 0")
	case *to == f.queue:
		return usagef(fs, name, "-to is the queue being replayed")
	case *to != "" && (len(allow) > 0 || *anyDest):
		return usagef(fs, name, "-to cannot be combined with -allow-topics or -any-destination")
	case len(allow) > 0 && *anyDest:
		return usagef(fs, name, "-allow-topics cannot be combined with -any-destination")
	}
	if err := sel.validate(); err != nil {
		return usagef(fs, name, "%v", err)
	}

	s, err := openDLQ(e, f)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := s.close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	if s.depth == 0 {
		fmt.Fprintf(e.stdout, "queue %q is empty; nothing to replay\n", f.queue)
		return nil
	}
	r := &replayer{e: e, s: s, sel: sel, to: *to, allow: allow, anyDest: *anyDest, act: *yes, uuidHeader: f.uuidHeader,
		dests: map[string]error{}, progress: newProgress(e.stderr, *every)}
	if r.act {
		if err := r.openPublisher(); err != nil {
			return err
		}
	}
	bound := s.depth
	if *limit > 0 {
		bound = min(bound, *limit)
	}
	err = r.run(bound)
	r.summary()
	return err
}

// replayer walks a dead-letter queue once and republishes the selected
// messages to their original queues.
type replayer struct {
	e          *env
	s          *dlqSession
	sel        selection
	to         string
	allow      []string // -allow-topics
	anyDest    bool     // -any-destination
	act        bool
	uuidHeader string

	pub     *amqp091.Channel // confirm mode
	returns chan amqp091.Return
	dests   map[string]error // destination queue -> result of its passive declare

	progress                              *progress
	examined, selected, replayed, skipped int
	handlers                              map[string]int // settle_handler of the examined messages -> how many
}

func (r *replayer) openPublisher() error {
	ch, err := r.s.conn.Channel()
	if err != nil {
		return fmt.Errorf("open publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("publisher confirms: %w", err)
	}
	// One publish is in flight at a time, and RabbitMQ sends basic.return
	// before the basic.ack of an unroutable mandatory message, so a buffer
	// of one holds the return of the current publish.
	r.returns = ch.NotifyReturn(make(chan amqp091.Return, 1))
	r.pub = ch
	return nil
}

// picked is a selected message, held until the replay ends.
type picked struct {
	d    amqp091.Delivery
	en   entry
	dest string // -to, or the message's settle_original_topic
}

// run reads up to bound messages, picks the selected ones, shows where they
// would go, checks that the operator allowed those destinations, and then
// replays (or describes) each. Reading everything first is what lets a
// replay refuse before it publishes anything: a copy on a dead-letter queue
// says where it came from, and anyone who can publish to that queue can
// write that (a copy forged to name another service's queue).
func (r *replayer) run(bound int) error {
	var picks []picked
	for r.examined < bound {
		if err := r.e.ctx.Err(); err != nil {
			return fmt.Errorf("interrupted: %w", err)
		}
		d, en, ok, err := r.s.next()
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		r.examined++
		if r.handlers == nil {
			r.handlers = map[string]int{}
		}
		r.handlers[en.Handler]++
		if r.sel.match(en) {
			r.selected++
			dest := r.to
			if dest == "" {
				dest = en.OriginalTopic
			}
			picks = append(picks, picked{d: d, en: en, dest: dest})
		}
		r.progress.tick("%s: examined %d of %d messages, %d selected", r.s.queue, r.examined, bound, r.selected)
	}
	if err := r.checkDestinations(picks); err != nil {
		if r.act {
			return err
		}
		fmt.Fprintf(r.e.stdout, "with -yes this replay is refused: %v\n", err)
	}
	for _, p := range picks {
		if err := r.e.ctx.Err(); err != nil {
			return fmt.Errorf("interrupted: %w", err)
		}
		if err := r.one(p.d, p.en, p.dest); err != nil {
			return err
		}
		r.progress.tick("%s: examined %d of %d messages, %d selected, %d replayed", r.s.queue, r.examined, bound, r.selected, r.replayed)
	}
	return nil
}

// errDestinations is the refusal of a replay whose messages go to several
// destinations that the operator did not allow.
var errDestinations = errors.New("the selected messages go to several destinations")

// checkDestinations prints the destinations of the picked messages and
// refuses more than one unless -to, -allow-topics or -any-destination says
// where the replay may go. Messages with no destination are skipped later,
// and -allow-topics skips those it does not name.
func (r *replayer) checkDestinations(picks []picked) error {
	count := map[string]int{}
	var names []string
	for _, p := range picks {
		if p.dest == "" || p.dest == r.s.queue {
			continue
		}
		if count[p.dest] == 0 {
			names = append(names, p.dest)
		}
		count[p.dest]++
	}
	if len(names) == 0 {
		return nil
	}
	sort.SliceStable(names, func(i, j int) bool {
		if count[names[i]] != count[names[j]] {
			return count[names[i]] > count[names[j]]
		}
		return names[i] < names[j]
	})
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s (%d)", safeLine(n), count[n])
	}
	list := strings.Join(parts, ", ")
	n := 0
	for _, c := range count {
		n += c
	}
	switch {
	case r.to != "":
		fmt.Fprintf(r.e.stdout, "the %d selected messages go to %s (-to)\n", n, list)
	case len(names) == 1:
		fmt.Fprintf(r.e.stdout, "the %d selected messages go to %s (their settle_original_topic)\n", n, list)
	default:
		fmt.Fprintf(r.e.stdout, "the %d selected messages go to %d destinations: %s\n", n, len(names), list)
	}
	if len(names) == 1 || r.to != "" || r.anyDest || len(r.allow) > 0 {
		return nil
	}
	return fmt.Errorf("%w: the selected messages go to %d destinations (%s), as their settle_original_topic says; "+
		"name the ones you mean with -allow-topics, send them all to one queue with -to, or pass -any-destination", errDestinations, len(names), list)
}

// one replays (or, in a dry run, describes) one selected message. The
// delivery is acked, removing it from the dead-letter queue, only after the
// broker confirmed the copy.
func (r *replayer) one(d amqp091.Delivery, en entry, dest string) error {
	out := r.e.stdout
	// What the message says is shown escaped (safeLine).
	id, to := safeLine(en.UUID), safeLine(dest)
	switch {
	case dest == "":
		r.skipped++
		fmt.Fprintf(out, "skip %s: no settle_original_topic (use -to)\n", id)
		return nil
	case dest == r.s.queue:
		r.skipped++
		fmt.Fprintf(out, "skip %s: its original topic is the queue being replayed\n", id)
		return nil
	case len(r.allow) > 0 && !slices.Contains(r.allow, dest):
		r.skipped++
		fmt.Fprintf(out, "skip %s: destination %s is not in -allow-topics\n", id, to)
		return nil
	}
	if err := r.checkDest(dest); err != nil {
		if !r.act {
			r.skipped++
			fmt.Fprintf(out, "skip %s: %s\n", id, safeLine(err.Error()))
			return nil
		}
		return err
	}
	p, newID := replayCopy(d, en, r.uuidHeader, time.Now())
	if !r.act {
		fmt.Fprintf(out, "would replay %s (%s, handler %s) to %s as %s\n", id, oneLine(dash(en.Outcome)), oneLine(dash(en.Handler)), to, newID)
		return nil
	}
	if err := r.publish(dest, p); err != nil {
		return fmt.Errorf("replay %s to %s: %w; it stays on %s", id, to, err, r.s.queue)
	}
	if err := r.s.ack(d); err != nil {
		return fmt.Errorf("replayed %s to %s as %s, but could not remove it from %s (a second replay gives the copy the same UUID, so dedupe drops it): %w",
			id, to, newID, r.s.queue, err)
	}
	r.replayed++
	fmt.Fprintf(out, "replayed %s to %s as %s\n", id, to, newID)
	return nil
}

// checkDest checks once per queue that dest exists: a message published to
// the default exchange with a routing key no queue has would be dropped.
func (r *replayer) checkDest(dest string) error {
	err, seen := r.dests[dest]
	if !seen {
		_, err = queueDepth(r.s.conn, dest)
		r.dests[dest] = err
	}
	return err
}

// publish sends p to queue dest the way watermill-amqp's durable queue
// config does (default exchange, routing key = queue name), mandatory, and
// waits for the broker's confirm.
func (r *replayer) publish(dest string, p amqp091.Publishing) error {
	ctx, cancel := context.WithTimeout(r.e.ctx, 30*time.Second)
	defer cancel()
	dc, err := r.pub.PublishWithDeferredConfirmWithContext(ctx, "", dest, true, false, p)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("waiting for the broker's confirm: %w", err)
	}
	if !acked {
		return errors.New("the broker did not confirm the publish (nack or closed channel)")
	}
	select {
	case ret := <-r.returns:
		return fmt.Errorf("the broker returned the message: %d %s", ret.ReplyCode, ret.ReplyText)
	default:
	}
	return nil
}

func (r *replayer) summary() {
	left := r.s.depth - r.replayed
	if !r.act {
		fmt.Fprintf(r.e.stdout, "dry run: %d of %d examined messages selected, %d would be replayed; nothing changed (add -yes to replay)\n",
			r.selected, r.examined, r.selected-r.skipped)
	} else {
		fmt.Fprintf(r.e.stdout, "replayed %d of %d examined messages (%d selected, %d skipped); about %d left on %s\n",
			r.replayed, r.examined, r.selected, r.skipped, left, safeLine(r.s.queue))
	}
	if r.selected == 0 && r.sel.handler != "" && r.examined > 0 && r.handlers[r.sel.handler] == 0 {
		fmt.Fprintf(r.e.stdout, "no examined message has handler %q; the handlers on %s: %s\n", r.sel.handler, safeLine(r.s.queue), r.handlerList())
	}
}

// handlerList is the settle_handler values of the examined messages with
// their counts, most frequent first: "charge (2), email (1)".
func (r *replayer) handlerList() string {
	names := make([]string, 0, len(r.handlers))
	for h := range r.handlers {
		names = append(names, h)
	}
	sort.Slice(names, func(i, j int) bool {
		if r.handlers[names[i]] != r.handlers[names[j]] {
			return r.handlers[names[i]] > r.handlers[names[j]]
		}
		return names[i] < names[j]
	})
	parts := make([]string, len(names))
	for i, h := range names {
		label := h
		if h == "" {
			label = "(none)"
		}
		parts[i] = fmt.Sprintf("%s (%d)", oneLine(label), r.handlers[h])
	}
	return strings.Join(parts, ", ")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
