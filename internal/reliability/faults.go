package reliability

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
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
	}
	return fmt.Errorf("unknown fault %q", f)
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
	fmt.Fprintf(tw, "exits without a kill\t%d\n", r.UnexpectedExits)
	for _, f := range r.Faults {
		rec := "NOT RECOVERED"
		if f.Recovered {
			rec = fmt.Sprintf("first effect %v after, backlog caught up %v after", f.Recovery.Round(time.Millisecond), f.CaughtUp.Round(time.Millisecond))
		}
		fmt.Fprintf(tw, "fault %s\t%v\t%s\n", f.Fault, f.Outage.Round(time.Millisecond), rec)
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
