// Command tracesvg draws one trace from Jaeger's HTTP API as an SVG: a span
// tree with a timeline bar per span, its duration, and settle's outcome. The
// Jaeger built from the Go module proxy serves the API but no web UI, so
// docs/tracing.md shows traces drawn by this command:
//
//	go run ./internal/cmd/tracesvg -api http://127.0.0.1:16686 -service settle-orders -tag order.id=A-007 -o docs/images/orders-trace.svg
//
// -in reads a saved /api/traces response instead of asking Jaeger.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"time"
)

func main() {
	var o options
	flag.StringVar(&o.api, "api", "http://127.0.0.1:16686", "Jaeger query API base URL")
	flag.StringVar(&o.service, "service", "settle-orders", "service whose traces to search")
	flag.StringVar(&o.tag, "tag", "", "pick the trace with a span carrying this key=value tag (default: the trace with most spans)")
	flag.StringVar(&o.in, "in", "", "read a saved /api/traces JSON response from this file instead of the API")
	flag.StringVar(&o.out, "o", "-", "output SVG file, - for stdout")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "tracesvg:", err)
		os.Exit(1)
	}
}

type options struct{ api, service, tag, in, out string }

// The parts of Jaeger's /api/traces response that are drawn.
type response struct {
	Data []jTrace `json:"data"`
}

type jTrace struct {
	TraceID string  `json:"traceID"`
	Spans   []jSpan `json:"spans"`
}

type jSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64  `json:"startTime"` // microseconds
	Duration  int64  `json:"duration"`  // microseconds
	Tags      []jTag `json:"tags"`
	Logs      []struct {
		Fields []jTag `json:"fields"`
	} `json:"logs"`
}

type jTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func (s jSpan) tag(key string) string {
	for _, t := range s.Tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func run(o options) error {
	var r io.Reader
	if o.in != "" {
		f, err := os.Open(o.in)
		if err != nil {
			return err
		}
		defer f.Close()
		r = f
	} else {
		u := strings.TrimRight(o.api, "/") + "/api/traces?limit=1000&service=" + url.QueryEscape(o.service)
		resp, err := http.Get(u)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", u, resp.Status)
		}
		r = resp.Body
	}
	var res response
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return fmt.Errorf("decoding the traces: %w", err)
	}
	tr, err := pick(res.Data, o.tag)
	if err != nil {
		return err
	}
	var w io.Writer = os.Stdout
	if o.out != "-" {
		f, err := os.Create(o.out)
		if err != nil {
			return err
		}
		defer f.Close()
		w = f
	}
	return draw(w, tr)
}

// pick returns the trace with a span tagged key=value, or the largest.
func pick(traces []jTrace, tag string) (jTrace, error) {
	if len(traces) == 0 {
		return jTrace{}, errors.New("no traces")
	}
	key, val, _ := strings.Cut(tag, "=")
	best := -1
	for i, t := range traces {
		if tag != "" {
			for _, s := range t.Spans {
				if s.tag(key) == val {
					return t, nil
				}
			}
			continue
		}
		if best < 0 || len(t.Spans) > len(traces[best].Spans) {
			best = i
		}
	}
	if best < 0 {
		return jTrace{}, fmt.Errorf("no trace has a span tagged %s", tag)
	}
	return traces[best], nil
}

// row is one span in drawing order.
type row struct {
	span  jSpan
	depth int
}

// order lays the spans out depth first, children by start time.
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
	var walk func(s jSpan, depth int)
	walk = func(s jSpan, depth int) {
		rows = append(rows, row{s, depth})
		kids := children[s.SpanID]
		byStart(kids)
		for _, k := range kids {
			walk(k, depth+1)
		}
	}
	for _, r := range roots {
		walk(r, 0)
	}
	return rows
}

const (
	rowH    = 26
	labelW  = 560
	barW    = 560
	padding = 16
)

func color(s jSpan) string {
	switch {
	case s.tag("otel.status_code") == "ERROR" || s.tag("error") == "true":
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

func draw(w io.Writer, t jTrace) error {
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
		padding, padding+12, html.EscapeString(t.TraceID), len(rows), time.Duration(total)*time.Microsecond)
	for i, r := range rows {
		y := padding + rowH*(i+1)
		s := r.span
		label := s.OperationName
		var notes []string
		if o := s.tag("settle.outcome"); o != "" {
			notes = append(notes, o)
		}
		if a := s.tag("settle.attempt"); a != "" {
			notes = append(notes, "attempt "+a)
		}
		if n := len(s.Logs); n > 0 {
			notes = append(notes, fmt.Sprintf("%d events", n))
		}
		if len(notes) > 0 {
			label += " [" + strings.Join(notes, ", ") + "]"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", padding+14*r.depth, y+16, html.EscapeString(label))
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
