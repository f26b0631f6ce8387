package main

import (
	_ "embed"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/template"
	"time"
)

//go:embed benchmarks.md.tmpl
var docTemplate string

// renderDoc fills the document's template with the results' tables.
func renderDoc(res *Results) (string, error) {
	t, err := template.New("benchmarks").Option("missingkey=error").Parse(docTemplate)
	if err != nil {
		return "", err
	}
	m := res.Machine
	var loads []string
	for _, s := range sections {
		if r, ok := res.Runs[s]; ok {
			loads = append(loads, fmt.Sprintf("%s %.1f", s, r.Load))
		}
	}
	conc := make([]string, len(amqpConcurrency))
	for i, c := range amqpConcurrency {
		conc[i] = strconv.Itoa(c)
	}
	d := map[string]any{
		"Runs": runsText(res),
		"Machine": fmt.Sprintf("- %d cores (`nproc`), CPU model `%s` (from `/proc/cpuinfo`)\n- %s\n"+
			"- PostgreSQL %s, `synchronous_commit = %s`, pgx v5 through `database/sql`\n"+
			"- MariaDB %s, InnoDB, go-sql-driver/mysql\n- SQLite %s through modernc.org/sqlite, file on local disk\n"+
			"- RabbitMQ %s, durable queues, watermill-amqp v3.0.2\n- measured %s",
			m.CPUs, m.CPUModel, m.Go, m.Postgres, m.PGSyncMode, m.MariaDB, m.SQLite, m.RabbitMQ, dates(res)),
		"CPUs":              m.CPUs,
		"Loads":             strings.Join(loads, ", "),
		"Summary":           summary(res),
		"Stack":             stackTable(res.Stack),
		"Attempts":          attemptsTable(res.Attempts),
		"Parked":            parkedTable(res.Parked),
		"Scale":             scaleTable(res.Scale),
		"StackN":            "–",
		"BareAllocs":        "–",
		"SettleExtraAllocs": "–",
		"StackVerdict":      stackVerdict(res.Stack),
		"Stores":            storesTable(res.Stores),
		"StoresBenchtime":   "–",
		"StoresCount":       "–",
		"TxCost":            txCostTable(res.TxCost),
		"Pgx":               pgxTable(res.Pgx),
		"PgxSeconds":        "–",
		"PgxRounds":         "–",
		"TxSeconds":         "–",
		"Concurrencies":     strings.Join(conc, ", "),
		"Prefetch":          "–",
		"RawN":              "–",
		"TxN":               "–",
		"AMQP":              amqpTable(res.AMQP),
		"Batch":             batchTable(res.Batch),
		"BatchVerdict":      batchVerdict(res.Batch),
		"Brokers":           brokersTable(res.Brokers),
		"Anchors":           anchorsTable(res.Anchors),
		"BrokersN":          "– messages for settle's cells and –",
		"Outbox":            "(not measured)",
		"OutboxTitle":       "",
		"OutboxArgs":        "",
		"Growth":            growthTables(res.Growth),
	}
	if s := res.Stack; s != nil {
		d["StackN"] = num(float64(s.N))
		d["BareAllocs"] = strconv.FormatFloat(s.Modes[modeBare].AllocsMsg, 'f', 0, 64)
		d["SettleExtraAllocs"] = strconv.FormatFloat(s.Modes[modeSettle].AllocsMsg-s.Modes[modeBare].AllocsMsg, 'f', 0, 64)
	}
	if s := res.Stores; s != nil {
		d["StoresBenchtime"], d["StoresCount"] = s.Benchtime, s.Count
	}
	if r := res.Pgx; r != nil {
		d["PgxSeconds"], d["PgxRounds"] = strconv.FormatFloat(r.Seconds, 'f', 0, 64), r.Rounds
	}
	if t := res.TxCost; t != nil {
		d["TxSeconds"] = strconv.FormatFloat(t.Seconds, 'f', 0, 64)
	}
	d["OneRawRange"], d["SeriesRange"] = "–", "–"
	if t := res.TxCost; t != nil {
		var rs []float64
		for _, r := range t.Rows {
			rs = append(rs, ratio(r.Rate[txOne], r.Rate[txRaw]))
		}
		d["OneRawRange"] = span(rs)
	}
	if a := res.AMQP; a != nil {
		d["Prefetch"], d["RawN"], d["TxN"] = a.Prefetch, num(float64(a.RawN)), num(float64(a.TxN))
		var rs []float64
		for _, r := range a.Rows {
			rs = append(rs, ratio(r.Rate[settleOne], 1/(1/r.Rate[amqpRaw]+1/r.Rate[pgRaw])))
		}
		d["SeriesRange"] = span(rs)
	}
	if r := res.Brokers; r != nil {
		d["BrokersN"] = num(float64(r.Messages)) + " messages for settle's cells and " + num(float64(r.RawN))
	}
	if o := res.Outbox; o != nil {
		d["Outbox"], d["OutboxTitle"], d["OutboxArgs"] = strings.TrimSpace(o.Table), o.Title, strings.Join(o.Args, " ")
	}
	var b strings.Builder
	if err := t.Execute(&b, d); err != nil {
		return "", err
	}
	return b.String(), nil
}

func runsText(res *Results) string {
	var ns []int
	for _, r := range res.Runs {
		if !slices.Contains(ns, r.Runs) {
			ns = append(ns, r.Runs)
		}
	}
	slices.Sort(ns)
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	if len(s) == 0 {
		return "3"
	}
	return strings.Join(s, " or ")
}

func dates(res *Results) string {
	var ds []string
	quick := false
	for _, r := range res.Runs {
		d, _, _ := strings.Cut(r.Date, " ")
		if !slices.Contains(ds, d) {
			ds = append(ds, d)
		}
		quick = quick || r.Quick
	}
	slices.Sort(ds)
	s := strings.Join(ds, ", ")
	if quick {
		s += " (some sections with -quick: smaller runs)"
	}
	return s
}

// summary is one line per target: settle's figure, its floor, the ratio.
func summary(res *Results) string {
	var b strings.Builder
	b.WriteString("| section | settle | floor | ratio | target | met |\n|---|---|---|---:|---:|---|\n")
	met := func(r, t float64) string {
		if r >= t {
			return "yes"
		}
		return "no (see the section)"
	}
	if s := res.Stack; s != nil {
		for _, c := range []struct {
			mode   string
			target float64
		}{{modeSettle, targetStack}, {modeTracing, targetTracing}, {modeDropped, targetDropped}} {
			cell, ok := s.Modes[c.mode]
			if !ok {
				continue
			}
			anchor, r := modeBare, cell.Ratio
			if cell.Anchor != "" {
				anchor, r = cell.Anchor, cell.AnchorRatio
			}
			fmt.Fprintf(&b, "| 2. GoChannel, %s | %s msgs/s | %s msgs/s (%s) | %s | %s | %s |\n",
				c.mode, num(cell.Rate), num(s.Modes[anchor].Rate), anchor, x(r), x(c.target), met(r, c.target))
		}
	}
	if s := res.Stores; s != nil {
		lo, hi := 0.0, 0.0
		first := true
		var worst StoreRow
		for _, r := range s.Rows {
			if r.Floor == 0 {
				continue
			}
			v := ratio(r.Settle, r.Floor)
			if first || v < lo {
				lo, worst = v, r
			}
			if first || v > hi {
				hi = v
			}
			first = false
		}
		cells := 0
		for _, r := range s.Rows {
			if r.Floor != 0 {
				cells++
			}
		}
		fmt.Fprintf(&b, "| 3. SQL stores, claim+confirm (%d cells) | | raw statements | %s–%s | %s | %s (lowest: %s at %d goroutines) |\n",
			cells, x(lo), x(hi), x(targetStores), met(lo, targetStores), worst.Store, worst.Goroutines)
	}
	if a := res.AMQP; a != nil {
		for _, mode := range []string{settleOne, settleTwoSt} {
			lo, hi := 0.0, 0.0
			for i, r := range a.Rows {
				v := ratio(r.Rate[mode], r.Floor())
				if i == 0 || v < lo {
					lo = v
				}
				if i == 0 || v > hi {
					hi = v
				}
			}
			fmt.Fprintf(&b, "| 4. RabbitMQ + PostgreSQL tx handler, %s, c=1..16 | | slower of raw AMQP / raw PG tx | %s–%s | %s | %s |\n",
				mode, x(lo), x(hi), x(targetAMQP), met(lo, targetAMQP))
		}
		lo, hi := 0.0, 0.0
		for i, r := range a.Rows {
			v := ratio(r.Rate[settleOne], 1/(1/r.Rate[amqpRaw]+1/r.Rate[pgRaw]))
			if i == 0 || v < lo {
				lo = v
			}
			if i == 0 || v > hi {
				hi = v
			}
		}
		fmt.Fprintf(&b, "| 4. the same, %s, against both dependencies in series | | 1/(1/amqp + 1/pg) | %s–%s | – | (no target; see the section) |\n",
			settleOne, x(lo), x(hi))
	}
	if t := res.Batch; t != nil {
		for _, r := range t.Rows {
			h := r.Rate[batchHandler]
			for _, c := range batchTargets {
				v := ratio(h, r.Rate[c.floor])
				target, verdict := x(c.target), met(v, c.target)
				if r.inFlight() != batchInFlight {
					target, verdict = "–", fmt.Sprintf("(the targets are for %d in flight)", batchInFlight)
				}
				cell := "batch handler" // the label names the in-flight count when it is not batchInFlight
				if r.inFlight() == batchInFlight {
					cell += fmt.Sprintf(", %d in flight", batchInFlight)
				}
				fmt.Fprintf(&b, "| 4b. RabbitMQ + %s, %s | %s msgs/s | %s msgs/s (%s) | %s | %s | %s |\n",
					r.label(), cell, num(h), num(r.Rate[c.floor]), c.name, x(v), target, verdict)
			}
			for _, cell := range []string{batchGrouped, batchHandler} {
				a := r.AddedP50[cell]
				if len(a) == 0 {
					continue
				}
				m := median(slices.Clone(a))
				wait := float64(batchWait) / float64(time.Millisecond)
				verdict := "yes"
				if m > wait {
					verdict = "no (see the section)"
					if p := r.AddedP50[batchPaused]; len(p) > 0 && m < median(slices.Clone(p)) {
						verdict = fmt.Sprintf("no: a plain %s pause adds %.2f ms (see the section)", batchWait, median(slices.Clone(p)))
					}
				}
				fmt.Fprintf(&b, "| 4b. RabbitMQ + %s, %s at %d msgs/s, latency added at p50 | %.2f ms | settle per message, same round | – | ≤ MaxWait (%s) | %s |\n",
					r.label(), cell, t.LatencyRate, m, batchWait, verdict)
			}
		}
	}
	anchorsSummary(&b, res.Anchors, met)
	return b.String()
}

func stackVerdict(s *StackResults) string {
	if s == nil {
		return ""
	}
	rs := s.Modes[modeSettle].Ratio
	tr, dr := s.Modes[modeTracing], s.Modes[modeDropped]
	var out []string
	if rs < targetStack {
		out = append(out, fmt.Sprintf("settle without tracing is at %s of the bare router, below the %s target: the bare router's no-op path costs only a few microseconds per message, so the fixed work settle must do per message (the key and its claim in the store, the claim's holder, the settlement record and the `settle_attempt` write) is a large share of it. With any handler that does real work the share falls accordingly: on RabbitMQ (section 4) the Go process is not the bottleneck at all.", x(rs), x(targetStack)))
	}
	if tr.Anchor != "" && tr.AnchorRatio < targetTracing {
		msg := fmt.Sprintf("With tracing, settle is at %s of `%s` (the bare router with one consumer span), below the %s target: settle's own work (the settle row's share) is in it as well as the spans.", x(tr.AnchorRatio), tr.Anchor, x(targetTracing))
		if b, sp, st := s.Modes[modeBare].Rate, s.Modes[tr.Anchor].Rate, s.Modes[modeSettle].Rate; b > 0 && sp > 0 && st > 0 {
			// Per message: one span's time plus settle's own, if tracing
			// cost settle no more than one span.
			tb, tsp, tst := 1/b, 1/sp, 1/st
			msg += fmt.Sprintf(" Even if settle's tracing cost no more than that one span, the time settle adds without tracing would put it at %s of `%s` in this run.", x(tsp/(tsp+tst-tb)), tr.Anchor)
		}
		out = append(out, msg)
	}
	if dr.Anchor != "" && dr.AnchorRatio < targetDropped {
		out = append(out, fmt.Sprintf("With a sampler that drops every trace, settle is at %s of settle without tracing, below the %s target (10%% more time per message).", x(dr.AnchorRatio), x(targetDropped)))
	}
	if dr.Anchor != "" && dr.AnchorRatio >= targetDropped && dr.AnchorCPU > 1/targetDropped {
		out = append(out, fmt.Sprintf("With a sampler that drops every trace, settle's rate is at %s of settle without tracing, within the target, but its CPU time per message is %.2f times settle's: on a loaded machine the rate can hide a cost the CPU time shows, so the target is met only if a quiet run agrees.", x(dr.AnchorRatio), dr.AnchorCPU))
	}
	if len(out) == 0 {
		return "The three targets are met in this run."
	}
	return strings.Join(out, "\n\n")
}

// span formats the range of ratios, "0.75x–0.82x".
func span(rs []float64) string {
	if len(rs) == 0 {
		return "–"
	}
	return x(slices.Min(rs)) + "–" + x(slices.Max(rs))
}
