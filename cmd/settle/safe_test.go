package main

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
)

// hostile is text from the wire meant for a terminal: an OSC that sets the
// window title, a screen clear, a C1 CSI (U+009B), a carriage return that
// hides what came before, NUL, DEL, a right-to-left override, and bytes
// that are not UTF-8.
const hostile = "a\x1b]0;pwned\x07b\x1b[2Jc\u009b31md\re\x00f\x7fg\u202eh\xff\xfei"

// unsafeOutput returns a description of the first thing in out that a
// terminal or an XML parser would act on: a control character other than
// newline and tab, a C1 control, a bidirectional override, invalid UTF-8.
func unsafeOutput(out string) string {
	for i := 0; i < len(out); {
		r, n := utf8.DecodeRuneInString(out[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			return fmt.Sprintf("invalid UTF-8 byte %#x at %d", out[i], i)
		case r < 0x20 && r != '\n' && r != '\t', r >= 0x7f && r <= 0x9f:
			return fmt.Sprintf("control character %U at %d", r, i)
		case bidiControl(r):
			return fmt.Sprintf("bidirectional control %U at %d", r, i)
		}
		i += n
	}
	return ""
}

func TestSafeText(t *testing.T) {
	t.Parallel()
	got := safeLine(hostile)
	if want := `a\x1b]0;pwned\x07b\x1b[2Jc\u009b31md\re\x00f\x7fg\u202eh\xff\xfei`; got != want {
		t.Errorf("safeLine = %s\nwant       %s", got, want)
	}
	if got := safeText("line 1\n\tline 2\r\n\x1b[0m"); got != "line 1\n\tline 2\\r\n\\x1b[0m" {
		t.Errorf("safeText = %q", got)
	}
	if got := safeLine("ünïcödé ✓ 漢字"); got != "ünïcödé ✓ 漢字" {
		t.Errorf("safeLine changed printable text: %q", got)
	}
}

// A dead-letter copy whose reason, handler, metadata and payload carry
// escape sequences is shown with them escaped, in the table, the detail
// view, JSON and replay's lines.
func TestDLQOutputIsEscaped(t *testing.T) {
	t.Parallel()
	b := setupBroker(t)
	dlq := b.queue(t, "dlq")
	orders := b.queue(t, "orders")
	uuid := "u-1\x1b[8m"
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	err = ch.Publish("", dlq, false, false, amqp091.Publishing{
		Headers: amqp091.Table{
			amqp.DefaultMessageUUIDHeaderKey: uuid,
			settle.MetaOutcome:               string(settle.DeadLettered) + hostile,
			settle.MetaReason:                "declined " + hostile,
			settle.MetaOriginalTopic:         orders,
			settle.MetaHandler:               "charge" + hostile,
			settle.MetaOriginalUUID:          uuid,
			"x-note" + hostile:               hostile,
		},
		Body: []byte("payload " + hostile + "\nline two\ttabbed"),
	})
	if err != nil {
		t.Fatal(err)
	}
	b.waitDepth(t, dlq, 1)

	for _, args := range [][]string{
		{"dlq", "list", "-queue", dlq},
		{"dlq", "list", "-queue", dlq, "-json"},
		{"dlq", "show", "-queue", dlq, uuid},
		{"dlq", "show", "-queue", dlq, "-json", uuid},
		{"dlq", "replay", "-queue", dlq, "-all"},
		{"dlq", "replay", "-queue", dlq, "-handler", "charge" + hostile},
	} {
		r := mustRun(t, exitOK, append(args, "-amqp", b.url)...)
		if p := unsafeOutput(r.stdout + r.stderr); p != "" {
			t.Errorf("%v: %s in\n%v", args[:2], p, r)
		}
		if !strings.Contains(r.stdout, `\x1b`) && !strings.Contains(r.stdout, `\u001b`) {
			t.Errorf("%v: the escape is not shown escaped:\n%v", args[:2], r)
		}
	}
	// JSON keeps the data: decoded, it is the original text (invalid
	// UTF-8 aside, which JSON cannot carry).
	r := mustRun(t, exitOK, "dlq", "list", "-queue", dlq, "-json", "-amqp", b.url)
	var got []entry
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatal(err)
	}
	if want := string([]rune("declined " + hostile)); len(got) != 1 || got[0].Reason != want {
		t.Errorf("JSON reason = %q, want %q", got[0].Reason, want)
	}
	// A replay to the copy's own destination prints escaped lines too.
	r = mustRun(t, exitOK, "dlq", "replay", "-queue", dlq, "-all", "-yes", "-amqp", b.url)
	if p := unsafeOutput(r.stdout + r.stderr); p != "" || !strings.Contains(r.stdout, "replayed u-1\\x1b[8m to "+orders) {
		t.Errorf("replay -yes: %s in\n%v", p, r)
	}
	b.waitDepth(t, orders, 1)
}

// Span names, tags, events and the trace ID from Jaeger are escaped in the
// tree, and the SVG is valid XML whatever they hold.
func TestTraceOutputIsEscaped(t *testing.T) {
	t.Parallel()
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	// JSON cannot carry invalid UTF-8: the saved response holds the rest.
	h := strings.ToValidUTF8(hostile, "")
	saved := `{"data":[{"traceID":` + q("aa"+h) + `,"processes":{"p1":{"serviceName":` + q("svc"+h) + `}},"spans":[
  {"spanID":"1","operationName":` + q("process <orders> & "+h) + `,"startTime":1000,"duration":50,"processID":"p1",
   "tags":[{"key":"settle.outcome","value":` + q("retry"+h) + `},{"key":"otel.status_code","value":"ERROR"},{"key":"otel.status_description","value":` + q("boom"+h) + `},
           {"key":"settle.handler","value":` + q("charge"+h) + `},{"key":"messaging.operation.type","value":"process"},{"key":"settle.attempt","value":` + q("1"+h) + `}],
   "logs":[{"timestamp":1010,"fields":[{"key":"event","value":` + q("failed"+h) + `},{"key":` + q("k"+h) + `,"value":` + q("v"+h) + `}]}]},
  {"spanID":"2","operationName":` + q("nack"+h) + `,"startTime":1040,"duration":5,"processID":"p1","references":[{"refType":"CHILD_OF","spanID":"1"}]}]}]}`
	dir := t.TempDir()
	path := filepath.Join(dir, "traces.json")
	if err := os.WriteFile(path, []byte(saved), 0o600); err != nil {
		t.Fatal(err)
	}
	r := mustRun(t, exitOK, "trace", "-in", path)
	if p := unsafeOutput(r.stdout + r.stderr); p != "" || !strings.Contains(r.stdout, `process <orders> & a\x1b]0;pwned`) {
		t.Errorf("tree: %s in\n%v", p, r)
	}
	r = mustRun(t, exitOK, "trace", "-in", path, "-svg", "-")
	if p := unsafeOutput(r.stdout); p != "" {
		t.Errorf("svg: %s in\n%s", p, r.stdout)
	}
	dec := xml.NewDecoder(strings.NewReader(r.stdout))
	var text strings.Builder
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("the SVG is not XML: %v\n%s", err, r.stdout)
		}
		if cd, ok := tok.(xml.CharData); ok {
			text.Write(cd)
		}
	}
	if !strings.Contains(text.String(), `process <orders> & a\x1b]0;pwned`) {
		t.Errorf("the SVG's text lacks the escaped span name:\n%s", text.String())
	}
	svg := filepath.Join(dir, "t.svg")
	mustRun(t, exitOK, "trace", "-in", path, "-svg", svg)
	data, err := os.ReadFile(svg)
	if err != nil {
		t.Fatal(err)
	}
	if err := xml.Unmarshal(data, new(struct{})); err != nil || !bytes.HasPrefix(data, []byte("<svg")) {
		t.Errorf("the SVG file is not XML: %v", err)
	}
}

// Whatever the text, what is printed is safe for a terminal and what is
// drawn is XML.
func FuzzSafeText(f *testing.F) {
	for _, s := range []string{hostile, "plain", "ünï ✓", "\xc2\x9b", "\xef\xbf\xbe", "a\u2066b", "&<>\"'", "\r\n\t"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		line, text := safeLine(s), safeText(s)
		if p := unsafeOutput(line); p != "" || strings.ContainsAny(line, "\n\t") {
			t.Errorf("safeLine(%q) = %q: %s", s, line, p)
		}
		if p := unsafeOutput(text); p != "" {
			t.Errorf("safeText(%q) = %q: %s", s, text, p)
		}
		if err := xml.Unmarshal([]byte("<text>"+svgText(s)+"</text>"), new(struct{})); err != nil {
			t.Errorf("svgText(%q) is not XML text: %v", s, err)
		}
		var b bytes.Buffer
		if err := writeJSON(&b, s); err != nil {
			t.Fatal(err)
		}
		var back string
		if p := unsafeOutput(b.String()); p != "" || json.Unmarshal(b.Bytes(), &back) != nil || back != string([]rune(s)) {
			t.Errorf("writeJSON(%q) = %q (%s), decodes to %q", s, b.String(), p, back)
		}
	})
}
