package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/settle-go/settle/internal/sqlurl"
)

// envJaegerURL names the Jaeger query API the trace command asks by default.
const envJaegerURL = "SETTLE_JAEGER_URL"

const defaultJaegerURL = "http://127.0.0.1:16686"

func runTrace(e *env, args []string) (err error) {
	const name = "trace"
	fs := newFlagSet(name)
	api := fs.String("jaeger", "", "Jaeger query API base URL (default $"+envJaegerURL+", else "+defaultJaegerURL+")")
	id := fs.String("id", "", "the trace ID")
	service := fs.String("service", "", "search the traces of this service (OTEL_SERVICE_NAME of the program)")
	tag := fs.String("tag", "", "with -service: the trace with a span tagged key=value, e.g. order.id=A-007")
	msgID := fs.String("message", "", "with -service: the trace of the message with this UUID (-tag messaging.message.id=UUID)")
	lookback := fs.Duration("lookback", time.Hour, "with -service: search traces that started this long ago at most")
	svg := fs.String("svg", "", "write the trace as an SVG picture to this file (- for stdout) instead of the tree")
	in := fs.String("in", "", "read a saved response of Jaeger's /api/traces instead of asking Jaeger")
	pos, err := parse(e, fs, name, args)
	if err != nil {
		return err
	}
	if *msgID != "" {
		if *tag != "" {
			return usagef(fs, name, "-message cannot be combined with -tag")
		}
		*tag = "messaging.message.id=" + *msgID
	}
	switch {
	case len(pos) == 1 && *id == "":
		*id = pos[0]
	case len(pos) > 0:
		return usagef(fs, name, "unexpected argument %q", pos[0])
	}
	switch {
	case *in == "" && *id == "" && *service == "":
		return usagef(fs, name, "say which trace: -id TRACE, or -service S (with -tag K=V to pick one)")
	case *id != "" && (*service != "" || *tag != ""):
		return usagef(fs, name, "-id cannot be combined with -service or -tag")
	case *tag != "" && !strings.Contains(*tag, "="):
		return usagef(fs, name, "-tag wants key=value, got %q", *tag)
	case *lookback <= 0:
		return usagef(fs, name, "-lookback must be > 0")
	}
	base := *api
	if base == "" {
		base = e.getenv(envJaegerURL)
	}
	if base == "" {
		base = defaultJaegerURL
	}
	if u, perr := url.Parse(base); perr != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return usagef(fs, name, "-jaeger: %q is not an http:// URL", redact(base))
	}

	var traces []jTrace
	if *in != "" {
		f, err := os.Open(*in)
		if err != nil {
			return err
		}
		defer f.Close()
		if traces, err = decodeTraces(f); err != nil {
			return fmt.Errorf("%s: %w", *in, err)
		}
	} else {
		q := jaegerQuery{base: strings.TrimRight(base, "/"), id: *id, service: *service, tag: *tag, lookback: *lookback}
		if traces, err = q.fetch(e.ctx); err != nil {
			return err
		}
	}
	tr, more, err := pick(traces, *id, *tag)
	if err != nil {
		return err
	}
	if more > 0 {
		fmt.Fprintf(e.stderr, "%d more traces match; showing the newest (choose one with -id)\n", more)
	}
	switch *svg {
	case "":
		return writeTree(e.stdout, tr)
	case "-":
		return drawSVG(e.stdout, tr)
	}
	f, err := os.Create(*svg)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	if err := drawSVG(f, tr); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "wrote trace %s (%d spans) to %s\n", tr.TraceID, len(tr.Spans), *svg)
	return nil
}

// The parts of Jaeger's query API responses (/api/traces, /api/traces/ID)
// that are shown.
type jResponse struct {
	Data   []jTrace `json:"data"`
	Errors []struct {
		Code int    `json:"code"`
		Msg  string `json:"msg"`
	} `json:"errors"`
}

type jTrace struct {
	TraceID   string  `json:"traceID"`
	Spans     []jSpan `json:"spans"`
	Processes map[string]struct {
		ServiceName string `json:"serviceName"`
	} `json:"processes"`
}

type jSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64  `json:"startTime"` // microseconds since the epoch
	Duration  int64  `json:"duration"`  // microseconds
	Tags      []jTag `json:"tags"`
	Logs      []struct {
		Timestamp int64  `json:"timestamp"`
		Fields    []jTag `json:"fields"`
	} `json:"logs"`
	ProcessID string `json:"processID"`
}

type jTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func tagOf(tags []jTag, key string) string {
	for _, t := range tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func (s jSpan) tag(key string) string { return tagOf(s.Tags, key) }

func (s jSpan) failed() bool { return s.tag("otel.status_code") == "ERROR" || s.tag("error") == "true" }

func decodeTraces(r io.Reader) ([]jTrace, error) {
	var res jResponse
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return nil, fmt.Errorf("decoding Jaeger's answer: %w", err)
	}
	if len(res.Errors) > 0 {
		return nil, fmt.Errorf("the query API answered: %s", res.Errors[0].Msg)
	}
	return res.Data, nil
}

type jaegerQuery struct {
	base, id, service, tag string
	lookback               time.Duration
}

// fetch asks Jaeger for the trace by ID, or for the service's traces (with
// a span tagged as -tag says) in the lookback window.
func (q jaegerQuery) fetch(ctx context.Context) ([]jTrace, error) {
	var u string
	if q.id != "" {
		u = q.base + "/api/traces/" + url.PathEscape(q.id)
	} else {
		v := url.Values{}
		v.Set("service", q.service)
		v.Set("limit", "100")
		end := time.Now()
		v.Set("start", strconv.FormatInt(end.Add(-q.lookback).UnixMicro(), 10))
		v.Set("end", strconv.FormatInt(end.UnixMicro(), 10))
		if q.tag != "" {
			k, val, _ := strings.Cut(q.tag, "=")
			tags, _ := json.Marshal(map[string]string{k: val})
			v.Set("tags", string(tags))
		}
		u = q.base + "/api/traces?" + v.Encode()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Close = true // one request per connection: nothing stays open after the command
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		// net/http hides the password of the URL it quotes, not a token in
		// its query.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("-jaeger: cannot reach Jaeger's query API at %s: %w", redact(q.base), sqlurl.ScrubError(err, q.base))
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound && q.id != "":
		return nil, fmt.Errorf("no trace %s in the Jaeger at %s", q.id, redact(q.base))
	case resp.StatusCode == http.StatusBadRequest && q.id == "":
		// Jaeger answers 400 for a service it has never seen.
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return nil, fmt.Errorf("the Jaeger at %s: %s (has service %q sent any span? its services: %s)",
			redact(q.base), strings.TrimSpace(string(b)), q.service, q.services(ctx))
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("the Jaeger at %s: %s", redact(u), resp.Status)
	}
	traces, err := decodeTraces(resp.Body)
	if err != nil {
		return nil, err
	}
	if len(traces) == 0 && q.id == "" {
		return nil, fmt.Errorf("no trace of service %q in the last %s matching %q in the Jaeger at %s (its services: %s)",
			q.service, q.lookback, q.tag, redact(q.base), q.services(ctx))
	}
	return traces, nil
}

// services lists the services Jaeger knows, for error messages.
func (q jaegerQuery) services(ctx context.Context) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, q.base+"/api/services", nil)
	if err != nil {
		return "unknown"
	}
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "unknown"
	}
	defer resp.Body.Close()
	var res struct {
		Data []string `json:"data"`
	}
	if json.NewDecoder(resp.Body).Decode(&res) != nil {
		return "unknown"
	}
	if len(res.Data) == 0 {
		return "none"
	}
	sort.Strings(res.Data)
	return strings.Join(res.Data, ", ")
}

// pick returns the trace to show: the one with the ID, or the newest with a
// span tagged key=value (any, without a tag), and how many others match.
func pick(traces []jTrace, id, tag string) (jTrace, int, error) {
	key, val, _ := strings.Cut(tag, "=")
	var match []jTrace
	for _, t := range traces {
		switch {
		case id != "":
			if strings.EqualFold(strings.TrimLeft(t.TraceID, "0"), strings.TrimLeft(id, "0")) {
				match = append(match, t)
			}
		case tag != "":
			for _, s := range t.Spans {
				if s.tag(key) == val {
					match = append(match, t)
					break
				}
			}
		default:
			match = append(match, t)
		}
	}
	if len(match) == 0 {
		switch {
		case id != "":
			return jTrace{}, 0, fmt.Errorf("no trace %s", id)
		case tag != "":
			return jTrace{}, 0, fmt.Errorf("no trace has a span tagged %s", tag)
		}
		return jTrace{}, 0, errors.New("no traces")
	}
	sort.SliceStable(match, func(i, j int) bool { return traceStart(match[i]) > traceStart(match[j]) })
	return match[0], len(match) - 1, nil
}

func traceStart(t jTrace) int64 {
	start := int64(1 << 62)
	for _, s := range t.Spans {
		start = min(start, s.StartTime)
	}
	return start
}

// row is one span in display order.
type row struct {
	span  jSpan
	depth int
	last  []bool // for each level down to this span: is it the last child there
}

// order lays the spans out depth first, children by start time. A span
// whose parent is not in the trace is a root.
func order(t jTrace) []row {
	byID := map[string]bool{}
	for _, s := range t.Spans {
		byID[s.SpanID] = true
	}
	children := map[string][]jSpan{}
	var roots []jSpan
	for _, s := range t.Spans {
		parent := ""
		for _, ref := range s.References {
			if ref.RefType == "CHILD_OF" && byID[ref.SpanID] {
				parent = ref.SpanID
			}
		}
		if parent == "" {
			roots = append(roots, s)
		} else {
			children[parent] = append(children[parent], s)
		}
	}
	byStart := func(ss []jSpan) {
		sort.SliceStable(ss, func(i, j int) bool { return ss[i].StartTime < ss[j].StartTime })
	}
	byStart(roots)
	var rows []row
	var walk func(s jSpan, last []bool)
	walk = func(s jSpan, last []bool) {
		rows = append(rows, row{span: s, depth: len(last) - 1, last: last})
		kids := children[s.SpanID]
		byStart(kids)
		for i, k := range kids {
			walk(k, append(append([]bool(nil), last...), i == len(kids)-1))
		}
	}
	for i, r := range roots {
		walk(r, []bool{i == len(roots)-1})
	}
	return rows
}

// notes are what a span's line says besides its name: settle's outcome and
// attempt, where a parked copy went, what the router did with the delivery
// (acked or nacked), and the error.
func notes(s jSpan) []string {
	var n []string
	if h := s.tag("settle.handler"); h != "" && s.tag("messaging.operation.type") == "process" {
		n = append(n, "handler "+h)
	}
	if o := s.tag("settle.outcome"); o != "" {
		n = append(n, o)
	}
	if a := s.tag("settle.attempt"); a != "" {
		n = append(n, "attempt "+a)
	}
	if p := s.tag("settle.parked_to"); p != "" {
		n = append(n, "parked to "+p)
	}
	// What the router did with the delivery, recorded on its process span
	// (a nack also has a span of its own under it).
	switch s.tag("settle.settled") {
	case "ack":
		n = append(n, "acked")
	case "nack":
		n = append(n, "nacked")
	}
	if d := s.tag("settle.router_decision"); d != "" {
		n = append(n, "router "+d)
	}
	if s.failed() {
		msg := s.tag("otel.status_description")
		if msg == "" {
			msg = "error"
		}
		n = append(n, "ERROR "+msg)
	}
	return n
}

func micros(us int64) string {
	d := time.Duration(us) * time.Microsecond
	switch {
	case d < time.Millisecond:
		return strconv.FormatInt(us, 10) + "µs"
	case d < time.Second:
		return strconv.FormatFloat(float64(us)/1000, 'f', 1, 64) + "ms"
	}
	return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) + "s"
}

// writeTree prints the trace as an indented tree, one span a line: when it
// started after the trace's first span, how long it took, its name and
// notes; the events of a span (a failed attempt) on lines below it.
func writeTree(w io.Writer, t jTrace) error {
	rows := order(t)
	start, end := traceStart(t), int64(0)
	for _, s := range t.Spans {
		end = max(end, s.StartTime+s.Duration)
	}
	var services []string
	seen := map[string]bool{}
	for _, s := range t.Spans {
		if p, ok := t.Processes[s.ProcessID]; ok && !seen[p.ServiceName] {
			seen[p.ServiceName] = true
			services = append(services, safeLine(p.ServiceName))
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "trace %s: %d spans in %s", safeLine(t.TraceID), len(t.Spans), micros(end-start))
	if len(services) > 0 {
		fmt.Fprintf(&b, ", service %s", strings.Join(services, ", "))
	}
	b.WriteString("\n\n")
	fmt.Fprintf(&b, "%9s %9s  %s\n", "start", "duration", "span")
	for _, r := range rows {
		var prefix, cont strings.Builder
		for i, last := range r.last[1:] {
			end := i == len(r.last)-2
			switch {
			case end && last:
				prefix.WriteString("└─ ")
				cont.WriteString("   ")
			case end:
				prefix.WriteString("├─ ")
				cont.WriteString("│  ")
			case last:
				prefix.WriteString("   ")
				cont.WriteString("   ")
			default:
				prefix.WriteString("│  ")
				cont.WriteString("│  ")
			}
		}
		s := r.span
		line := s.OperationName
		if n := notes(s); len(n) > 0 {
			line += "  [" + strings.Join(n, ", ") + "]"
		}
		line = safeLine(line) // names and tags are the traced program's
		fmt.Fprintf(&b, "%9s %9s  %s%s\n", micros(s.StartTime-start), micros(s.Duration), prefix.String(), line)
		for _, l := range s.Logs {
			ev := tagOf(l.Fields, "event")
			var parts []string
			for _, f := range l.Fields {
				if f.Key != "event" {
					parts = append(parts, f.Key+"="+fmt.Sprint(f.Value))
				}
			}
			fmt.Fprintf(&b, "%9s %9s  %s   · %s %s\n", micros(l.Timestamp-start), "", cont.String(), safeLine(ev), safeLine(strings.Join(parts, " ")))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

const (
	rowH    = 26
	labelW  = 560
	barW    = 560
	padding = 16
)

func color(s jSpan) string {
	switch {
	case s.failed():
		return "#d9534f"
	case s.tag("settle.outcome") == "duplicate" || s.tag("settle.outcome") == "deferred":
		return "#f0ad4e"
	case s.tag("span.kind") == "producer":
		return "#5b8def"
	case s.tag("span.kind") == "consumer":
		return "#3c9d5d"
	default:
		return "#8c8c8c"
	}
}

// drawSVG draws the trace as a picture: the span tree with a timeline bar
// per span, its duration, and settle's outcome.
func drawSVG(w io.Writer, t jTrace) error {
	rows := order(t)
	start, end := int64(1<<62), int64(0)
	for _, r := range rows {
		start = min(start, r.span.StartTime)
		end = max(end, r.span.StartTime+r.span.Duration)
	}
	total := max(end-start, 1)
	width := padding*2 + labelW + barW
	height := padding*2 + rowH*(len(rows)+2)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="monospace" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="%d" font-weight="bold">trace %s: %d spans, %s</text>`+"\n",
		padding, padding+12, svgText(t.TraceID), len(rows), time.Duration(total)*time.Microsecond)
	for i, r := range rows {
		y := padding + rowH*(i+1)
		s := r.span
		label := s.OperationName
		var n []string
		if o := s.tag("settle.outcome"); o != "" {
			n = append(n, o)
		}
		if a := s.tag("settle.attempt"); a != "" {
			n = append(n, "attempt "+a)
		}
		if k := len(s.Logs); k > 0 {
			n = append(n, fmt.Sprintf("%d events", k))
		}
		if len(n) > 0 {
			label += " [" + strings.Join(n, ", ") + "]"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", padding+14*r.depth, y+16, svgText(label))
		x := padding + labelW + int(float64(s.StartTime-start)/float64(total)*barW)
		bw := max(int(float64(s.Duration)/float64(total)*barW), 2)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" rx="2" fill="%s"/>`+"\n", x, y+4, bw, rowH-10, color(s))
		dur := (time.Duration(s.Duration) * time.Microsecond).Round(10 * time.Microsecond)
		tx := x + bw + 4
		anchor := "start"
		if tx > width-120 {
			tx, anchor = x-4, "end"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555" text-anchor="%s">%s</text>`+"\n", tx, y+16, anchor, dur)
	}
	legendY := padding + rowH*(len(rows)+1) + 16
	lx := padding
	for _, l := range []struct{ c, name string }{{"#3c9d5d", "consumer"}, {"#5b8def", "producer"}, {"#8c8c8c", "internal/client"}, {"#f0ad4e", "duplicate/deferred"}, {"#d9534f", "error"}} {
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", lx, legendY-10, l.c, lx+16, legendY, l.name)
		lx += 40 + 8*len(l.name)
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
