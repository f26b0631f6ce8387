package main

import (
	"fmt"
	"strconv"
	"strings"
)

// Targets of the performance issue: settle's figure over its floor.
const (
	// Issue 28: settle over the bare router; settle+tracing over the bare
	// router with one consumer span (bare+span); settle with a sampler that
	// drops every trace may take at most 10% more time per message than
	// settle without tracing, a rate ratio of 1/1.1.
	targetStack   = 0.9
	targetTracing = 0.9
	targetDropped = 1 / 1.1
	targetStores  = 0.8
	targetAMQP    = 0.7
	// Issue 16: the batch handler against settle's per-message handler and
	// the raw per-message transaction; the raw consume ratio is its stretch.
	targetBatchPerMsg  = 3.0
	targetBatchRawTx   = 1.0
	targetBatchConsume = 0.5
)

// num formats a rate with thousands separators.
func num(f float64) string {
	s := strconv.FormatFloat(f, 'f', 0, 64)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func x(r float64) string { return strconv.FormatFloat(r, 'f', 2, 64) + "x" }

// verdict marks a ratio against its target.
func verdict(r, target float64) string {
	if r >= target {
		return x(r)
	}
	return x(r) + " (below " + strconv.FormatFloat(target, 'f', 1, 64) + "x)"
}

func sectionTables(res *Results, name string) string {
	switch name {
	case "stack":
		return stackTable(res.Stack)
	case "stores":
		return storesTable(res.Stores)
	case "txcost":
		return txCostTable(res.TxCost)
	case "pgx":
		return pgxTable(res.Pgx)
	case "amqp":
		return amqpTable(res.AMQP)
	case "batch":
		return batchTable(res.Batch)
	case "brokers":
		return brokersTable(res.Brokers)
	case "anchors":
		return anchorsTable(res.Anchors)
	case "outbox":
		if res.Outbox == nil {
			return ""
		}
		return res.Outbox.Title + "\n\n" + res.Outbox.Table
	case "growth":
		return growthTables(res.Growth)
	case "attempts":
		return attemptsTable(res.Attempts)
	case "parked":
		return parkedTable(res.Parked)
	case "nats":
		return natsTable(res.NATS)
	case "redis":
		return redisTable(res.Redis)
	case "scale":
		return scaleTable(res.Scale)
	}
	return ""
}

func stackTable(s *StackResults) string {
	if s == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| router | msgs/s (median) | CPU µs/msg | allocs/msg | bytes/msg | ratio to bare | ratio to its anchor (CPU/msg ratio) | target |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, m := range stackModes {
		c, ok := s.Modes[m]
		if !ok {
			continue
		}
		r, a, t := x(c.Ratio), "–", "–"
		switch m {
		case modeBare:
			r = "1.00x"
		case modeSettle:
			r, t = verdict(c.Ratio, targetStack), fmt.Sprintf(">= %.1fx of bare", targetStack)
		case modeTracing:
			t = fmt.Sprintf(">= %.1fx of %s", targetTracing, c.Anchor)
		case modeDropped:
			t = fmt.Sprintf(">= %.2fx of %s (<= 10%% more time)", targetDropped, c.Anchor)
		}
		if c.Anchor != "" {
			target := targetTracing
			if m == modeDropped {
				target = targetDropped
			}
			a = fmt.Sprintf("%s of %s (%.2f)", verdict(c.AnchorRatio, target), c.Anchor, c.AnchorCPU)
		}
		cpu := "–"
		if c.CPUMsg > 0 {
			cpu = strconv.FormatFloat(c.CPUMsg, 'f', 1, 64)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.1f | %s | %s | %s | %s |\n", m, num(c.Rate), cpu, c.AllocsMsg, num(c.BytesMsg), r, a, t)
	}
	return b.String()
}

func storesTable(s *StoresResults) string {
	if s == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| store | goroutines | settle msgs/s | floor msgs/s | settle/floor |\n|---|---:|---:|---:|---:|\n")
	for _, r := range s.Rows {
		name := r.Store
		if name == "mysql" {
			name = "mysql (MariaDB)"
		}
		fl, rt := "–", "–"
		if r.Floor > 0 {
			fl, rt = num(r.Floor), verdict(ratio(r.Settle, r.Floor), targetStores)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s |\n", name, r.Goroutines, num(r.Settle), fl, rt)
	}
	return b.String()
}

func txCostTable(t *TxCostResults) string {
	if t == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| goroutines | raw: BEGIN; INSERT; COMMIT | raw+key: BEGIN; INSERT key; INSERT; COMMIT | settle one-statement | settle default (claim outside, confirm inside) | one-statement/raw | default/raw | one-statement/raw+key |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range t.Rows {
		raw := r.Rate[txRaw]
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s |\n", r.Goroutines, num(raw), num(r.Rate[txRawKey]), num(r.Rate[txOne]), num(r.Rate[txDefault]),
			x(ratio(r.Rate[txOne], raw)), x(ratio(r.Rate[txDefault], raw)), x(ratio(r.Rate[txOne], r.Rate[txRawKey])))
	}
	return b.String()
}

func amqpTable(a *AMQPResults) string {
	if a == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| concurrency | raw AMQP consume | raw PG tx | floor (slower) | both in series | settle one-statement | ratio to floor | settle default | ratio to floor | effects checked |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range a.Rows {
		fl := r.Floor()
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.Concurrency,
			num(r.Rate[amqpRaw]), num(r.Rate[pgRaw]), num(fl), num(1/(1/r.Rate[amqpRaw]+1/r.Rate[pgRaw])),
			num(r.Rate[settleOne]), verdict(ratio(r.Rate[settleOne], fl), targetAMQP),
			num(r.Rate[settleTwoSt]), verdict(ratio(r.Rate[settleTwoSt], fl), targetAMQP),
			num(float64(r.Checked)))
	}
	return b.String()
}

func growthTables(g *GrowthResults) string {
	if g == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("GoChannel, no-op handler, µs per message (median):\n\n| messages | bare router | settle (memory store) |\n|---:|---:|---:|\n")
	for _, r := range g.Stack {
		fmt.Fprintf(&b, "| %s | %.2f | %.2f |\n", num(float64(r.N)), r.USMs[modeBare], r.USMs[modeSettle])
	}
	fmt.Fprintf(&b, "\nPostgreSQL store, claim+confirm of fresh keys from %d goroutines on a new table, µs per message (wall time / messages):\n\n| messages | µs/msg | msgs/s |\n|---:|---:|---:|\n", g.Goroutines)
	for _, r := range g.PG {
		us := r.USMs["postgres"]
		fmt.Fprintf(&b, "| %s | %.1f | %s |\n", num(float64(r.N)), us, num(1e6/us))
	}
	p := g.Prefilled
	fmt.Fprintf(&b, "\nPre-filled table (%s confirmed keys, filled in %.1f s with one INSERT … SELECT generate_series):\n\n", num(float64(p.Rows)), p.FillSeconds)
	b.WriteString("| | µs/msg | msgs/s |\n|---|---:|---:|\n")
	fmt.Fprintf(&b, "| claim+confirm of %s fresh keys, empty table | %.1f | %s |\n", num(float64(p.N)), p.EmptyUS, num(1e6/p.EmptyUS))
	fmt.Fprintf(&b, "| claim+confirm of %s fresh keys, %s rows | %.1f | %s |\n", num(float64(p.N)), num(float64(p.Rows)), p.FullUS, num(1e6/p.FullUS))
	fmt.Fprintf(&b, "\nPrune of the %s old rows (batches of 5,000): %.1f s, %s rows/s.\n", num(float64(p.Pruned)), p.PruneSecs, num(float64(p.Pruned)/p.PruneSecs))
	return b.String()
}
