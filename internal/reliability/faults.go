package reliability

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/sqldb"
)

// faults injects each configured fault while a producer keeps placing
// messages, and measures how long the processes take to produce effects
// again.
func (d *driver) faults(ctx context.Context) error {
	pctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var placeErr error
	var mu sync.Mutex // guards d.next against the fault code reading it
	wg.Go(func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-pctx.Done():
				return
			case <-t.C:
			}
			mu.Lock()
			err := d.place(pctx, 1) // 50 messages/s, well below the relay's pace
			mu.Unlock()
			if err != nil && pctx.Err() == nil {
				placeErr = err
				return
			}
		}
	})
	defer func() {
		stop()
		wg.Wait()
	}()
	for _, f := range d.cfg.Faults {
		// Let the claims of consumers killed before lapse, so that the
		// figures below are the fault's alone.
		if err := sleepCtx(ctx, d.cfg.ClaimTimeout+time.Second); err != nil {
			return err
		}
		if err := d.checkExits(); err != nil {
			return err
		}
		d.say("fault %s", f)
		began := time.Now()
		if err := d.inject(ctx, f); err != nil {
			return fmt.Errorf("reliability: fault %s: %w", f, err)
		}
		fr := FaultResult{Fault: f, Outage: time.Since(began)}
		restored := time.Now()
		mu.Lock()
		upTo := d.next - 1 // the backlog: everything placed until now
		mu.Unlock()
		base := -1
		rctx, cancel := context.WithTimeout(ctx, d.cfg.RecoverTimeout)
		for rctx.Err() == nil {
			if err := d.checkExits(); err != nil {
				cancel()
				return err
			}
			effects, missing, err := d.progress(rctx, upTo)
			switch {
			case err != nil:
			case base < 0:
				base = effects
			case !fr.Recovered && effects > base:
				fr.Recovered, fr.Recovery = true, time.Since(restored)
			}
			if err == nil && fr.Recovered && missing == 0 {
				fr.CaughtUp = time.Since(restored)
				break
			}
			_ = sleepCtx(rctx, 10*time.Millisecond)
		}
		cancel()
		d.res.Faults = append(d.res.Faults, fr)
		d.say("fault %s: outage %v, first effect after %v, caught up after %v (recovered=%v)",
			f, fr.Outage.Round(time.Millisecond), fr.Recovery.Round(time.Millisecond), fr.CaughtUp.Round(time.Millisecond), fr.Recovered)
	}
	if err := sleepCtx(ctx, time.Second); err != nil {
		return err
	}
	stop()
	wg.Wait()
	return placeErr
}

// natsServer is the server binary that FaultNATS stops, and natsStart the
// arguments it is started again with: the machine's own command (see the
// machine's notes), JetStream on, its store in /var/lib/nats-server.
const natsServer = "/usr/sbin/nats-server"

var natsStart = []string{"--start", "--oknodo", "--background", "--exec", natsServer, "--",
	"-a", "127.0.0.1", "-p", "4222", "-js", "-sd", "/var/lib/nats-server", "-l", "/var/log/nats-server.log"}

// restartNATS stops nats-server, waits Config.FaultHold, starts it again
// and waits until JetStream answers for the campaign's consumer. Whatever
// happens after the stop, the server is started again before it returns.
func (d *driver) restartNATS(ctx context.Context) (err error) {
	if err := command(ctx, "start-stop-daemon", "--stop", "--oknodo", "--retry", "TERM/15/KILL/5", "--exec", natsServer); err != nil {
		return err
	}
	started := false
	defer func() {
		if !started {
			err = errors.Join(err, command(context.WithoutCancel(ctx), "start-stop-daemon", natsStart...))
		}
	}()
	if err := sleepCtx(ctx, d.cfg.FaultHold); err != nil {
		return err
	}
	started = true
	if err := command(ctx, "start-stop-daemon", natsStart...); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, _, err := d.broker.depth(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nats-server started, JetStream not answering after 30s: %w", err)
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}

// inject causes one fault and returns once the service is back (or, for
// pgterminate, once the connections are gone).
func (d *driver) inject(ctx context.Context, f string) error {
	switch f {
	case FaultRabbitMQ:
		if err := command(ctx, "rabbitmqctl", "stop_app"); err != nil {
			return err
		}
		// Whatever happens, start it again.
		defer func() {
			_ = command(context.WithoutCancel(ctx), "rabbitmqctl", "start_app")
		}()
		if err := sleepCtx(ctx, d.cfg.FaultHold); err != nil {
			return err
		}
		return command(ctx, "rabbitmqctl", "start_app")
	case FaultNATS:
		return d.restartNATS(ctx)
	case FaultPostgres:
		out, err := exec.CommandContext(ctx, "pg_lsclusters", "-h").Output()
		if err != nil {
			return fmt.Errorf("pg_lsclusters: %w", err)
		}
		fields := strings.Fields(string(out))
		if len(fields) < 2 {
			return fmt.Errorf("pg_lsclusters printed %q", out)
		}
		return command(ctx, "pg_ctlcluster", "--skip-systemctl-redirect", fields[0], fields[1], "restart")
	case FaultPGTerminate:
		// Terminate every other connection of the run to this database:
		// the relay's, the consumers' and the driver's own pool's. Other
		// users of the database are spared.
		rows, err := d.db.QueryContext(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name = $1", d.appName)
		if err != nil {
			return err
		}
		n := 0
		for rows.Next() {
			n++
		}
		d.say("pg_terminate_backend on %d connections", n)
		return errors.Join(rows.Err(), rows.Close())
	case FaultSIGSTOP:
		return d.zombie(ctx)
	}
	return fmt.Errorf("unknown fault %q", f)
}

// zombie is one FaultSIGSTOP: a consumer caught in its handler, after its
// effect and before its commit, is stopped past its claim timeout; a second
// delivery of its message (as the relay or the broker may make) is
// published, and once the other consumer has taken the expired claim over
// and committed the message's effect (or RecoverTimeout passed) the stopped
// one is woken. A stop that does not land in a handler is undone at once and
// tried again, for up to 30s.
func (d *driver) zombie(ctx context.Context) error {
	var consumers []*proc
	for _, p := range d.procs {
		if p.spec.Role == roleConsumer {
			consumers = append(consumers, p)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for tries := 1; ; tries++ {
		if time.Now().After(deadline) {
			d.res.ZombieMisses++
			d.say("sigstop: no consumer caught in its handler in %d tries", tries)
			return nil
		}
		if err := d.checkExits(); err != nil {
			return err
		}
		p := consumers[d.rnd.IntN(len(consumers))]
		if phase, id := handlerStatus(p.status()); phase != phaseHandler || id == "" {
			if err := sleepCtx(ctx, 200*time.Microsecond); err != nil {
				return err
			}
			continue
		}
		pid := p.cmd.Process.Pid
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			continue // it has just exited; checkExits restarts it
		}
		// The status file of a stopped process says where it stopped.
		phase, id := handlerStatus(p.status())
		if phase != phaseHandler || id == "" {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			continue
		}
		d.say("sigstop %s (pid %d) in its handler of %s, after %d tries", p.spec.Name, pid, id, tries)
		z, err := d.holdZombie(ctx, pid, id)
		// Whatever happened, wake it.
		if cerr := p.cmd.Process.Signal(syscall.SIGCONT); cerr != nil && !errors.Is(cerr, os.ErrProcessDone) && err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		if z.takenOver {
			d.zombies = append(d.zombies, z)
			d.res.Zombies++
		} else {
			d.res.ZombieMisses++
		}
		d.say("sigcont %s (pid %d): %s taken over by the other consumer: %v", p.spec.Name, pid, id, z.takenOver)
		return nil
	}
}

// zombie is a consumer that FaultSIGSTOP stopped in its handler of msgID.
type zombie struct {
	pid       int
	msgID     string
	takenOver bool // another consumer committed msgID's effect while it slept
}

// holdZombie keeps process pid stopped past its claim, publishes a second
// delivery of msgID (and more, while none reached the other consumer) and
// waits for another process's effect of it.
func (d *driver) holdZombie(ctx context.Context, pid int, msgID string) (zombie, error) {
	z := zombie{pid: pid, msgID: msgID}
	if err := sleepCtx(ctx, d.cfg.ClaimTimeout+500*time.Millisecond); err != nil {
		return z, err
	}
	q := "SELECT COUNT(*) FROM " + d.effects + " WHERE msg_id = ? AND pid <> ?"
	if d.dialect == sqldb.Postgres {
		q = "SELECT COUNT(*) FROM " + d.effects + " WHERE msg_id = $1 AND pid <> $2"
	}
	wctx, cancel := context.WithTimeout(ctx, d.cfg.RecoverTimeout)
	defer cancel()
	var sent time.Time
	for {
		// The broker may push the second delivery to the stopped consumer,
		// which still has prefetch to spare: send another every 3s.
		if time.Since(sent) >= 3*time.Second {
			if err := d.redeliver(wctx, msgID); err != nil && wctx.Err() == nil {
				return z, err
			}
			sent = time.Now()
		}
		var others int
		if err := d.db.QueryRowContext(wctx, q, msgID, pid).Scan(&others); err == nil && others > 0 {
			z.takenOver = true
			return z, nil
		}
		if err := sleepCtx(wctx, 20*time.Millisecond); err != nil {
			return z, ctx.Err() // nil when only the wait ran out
		}
	}
}

// redeliver publishes a second delivery of the placed message msgID to the
// campaign's queue, as the relay does after a crash between a publish and
// its mark.
func (d *driver) redeliver(ctx context.Context, msgID string) error {
	q := "SELECT seq FROM " + d.placed + " WHERE msg_id = ?"
	if d.dialect == sqldb.Postgres {
		q = "SELECT seq FROM " + d.placed + " WHERE msg_id = $1"
	}
	var seq int
	if err := d.db.QueryRowContext(ctx, q, msgID).Scan(&seq); err != nil {
		return fmt.Errorf("reliability: redeliver %s: %w", msgID, err)
	}
	return d.broker.publish(ctx, message.NewMessage(msgID, []byte(fmt.Sprintf(`{"seq":%d}`, seq))))
}

// handlerStatus splits a consumer's status line into its phase and, in its
// handler, the id of the message.
func handlerStatus(line string) (phase, msgID string) {
	phase, rest, _ := strings.Cut(line, " ")
	return phase, strings.TrimSpace(rest)
}

// countZombies counts the zombies whose own transaction committed an effect
// of the message another consumer had taken over.
func (d *driver) countZombies(ctx context.Context) error {
	q := "SELECT COUNT(*) FROM " + d.effects + " WHERE msg_id = ? AND pid = ?"
	if d.dialect == sqldb.Postgres {
		q = "SELECT COUNT(*) FROM " + d.effects + " WHERE msg_id = $1 AND pid = $2"
	}
	for _, z := range d.zombies {
		var n int
		if err := d.db.QueryRowContext(ctx, q, z.msgID, z.pid).Scan(&n); err != nil {
			return fmt.Errorf("reliability: count zombies: %w", err)
		}
		if n > 0 {
			d.res.ZombieCommits++
			d.say("zombie pid %d committed its effect of %s after the takeover", z.pid, z.msgID)
		}
	}
	return nil
}

func command(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Print writes the result as a table.
func (r Result) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "mode\t%s\n", r.Mode)
	fmt.Fprintf(tw, "broker\t%s\n", r.Broker)
	fmt.Fprintf(tw, "database\t%s\n", r.Dialect)
	fmt.Fprintf(tw, "seed\t%d\n", r.Seed)
	fmt.Fprintf(tw, "kill cycles\t%d\n", r.Cycles)
	for _, role := range []string{roleRelay, roleConsumer} {
		m := r.Kills[role]
		var parts []string
		total := 0
		for _, p := range sortedPhases(m) {
			parts = append(parts, fmt.Sprintf("%s %d", p, m[p]))
			total += m[p]
		}
		fmt.Fprintf(tw, "kills of %s\t%d\t%s\n", role, total, strings.Join(parts, ", "))
	}
	if r.GracefulStops > 0 {
		fmt.Fprintf(tw, "of those, graceful stops (SIGTERM)\t%d\n", r.GracefulStops)
	}
	fmt.Fprintf(tw, "exits without a kill\t%d\n", r.UnexpectedExits)
	for _, f := range r.Faults {
		rec := "NOT RECOVERED"
		if f.Recovered {
			rec = fmt.Sprintf("first effect %v after, backlog caught up %v after", f.Recovery.Round(time.Millisecond), f.CaughtUp.Round(time.Millisecond))
		}
		fmt.Fprintf(tw, "fault %s\t%v\t%s\n", f.Fault, f.Outage.Round(time.Millisecond), rec)
	}
	if r.Zombies > 0 || r.ZombieMisses > 0 {
		fmt.Fprintf(tw, "zombies (SIGSTOP in a handler, message taken over)\t%d\t%d committed after waking; %d stops missed\n", r.Zombies, r.ZombieCommits, r.ZombieMisses)
	}
	fmt.Fprintf(tw, "messages placed\t%d\n", r.Placed)
	fmt.Fprintf(tw, "effect rows\t%d\n", r.Effects)
	fmt.Fprintf(tw, "lost\t%d\n", r.Lost)
	fmt.Fprintf(tw, "duplicated (messages)\t%d\t%d extra effect rows\n", r.Duplicated, r.Extra)
	fmt.Fprintf(tw, "effects of unplaced ids\t%d\n", r.Unplaced)
	fmt.Fprintf(tw, "dead-lettered/poisoned\t%d\n", r.DeadLettered)
	fmt.Fprintf(tw, "left on queue\t%d\n", r.LeftOnQueue)
	fmt.Fprintf(tw, "claims acquired\t%d\n", r.ClaimRuns)
	if r.Mode == ModeBatch {
		mean := 0.0
		if r.Transactions > 0 {
			mean = float64(r.Effects) / float64(r.Transactions)
		}
		fmt.Fprintf(tw, "committed transactions\t%d\t%.1f effects each on average, at most %d\n", r.Transactions, mean, r.LargestBatch)
		var sizes []string
		for size := 1; size <= r.LargestBatch; size++ {
			if n := r.BatchSizes[size]; n > 0 {
				sizes = append(sizes, fmt.Sprintf("%d×%d", n, size))
			}
		}
		fmt.Fprintf(tw, "transactions by size\t\t%s\n", strings.Join(sizes, ", "))
		fmt.Fprintf(tw, "kills in a batch\t%d\t%d aimed; %d before the commit (the batch left no row), %d raced the commit\n",
			r.BatchKills, r.Aimed, r.BatchKillsUncommitted, r.BatchKills-r.BatchKillsUncommitted)
	}
	fmt.Fprintf(tw, "drain\t%v\n", r.DrainTime.Round(time.Millisecond))
	fmt.Fprintf(tw, "total\t%v\n", r.Duration.Round(time.Millisecond))
	verdict := "PASS"
	if err := r.Err(); err != nil {
		verdict = "FAIL: " + strings.ReplaceAll(err.Error(), "\n", "; ")
	}
	fmt.Fprintf(tw, "verdict\t%s\n", verdict)
	_ = tw.Flush()
}
