package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode/utf8"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/amqpmarshal"
)

// entry is one message on a dead-letter or poison queue, as settle's
// metadata describes it.
type entry struct {
	UUID          string `json:"uuid"`
	Outcome       string `json:"outcome,omitempty"`
	Reason        string `json:"reason,omitempty"`
	OriginalTopic string `json:"original_topic,omitempty"`
	Handler       string `json:"handler,omitempty"`
	OriginalUUID  string `json:"original_uuid,omitempty"`
	Attempts      int    `json:"attempts,omitempty"`
	FirstFailure  string `json:"first_failure_at,omitempty"`
	LastFailure   string `json:"last_failure_at,omitempty"`
	// Metadata is all of the message's metadata, as settle's AMQP marshaler
	// decodes the headers.
	Metadata map[string]string `json:"metadata"`
	payloadJSON
	PayloadBytes int `json:"payload_bytes"`
}

// payloadJSON is a message's body in JSON output: Payload when it is UTF-8
// text, PayloadBase64 otherwise.
type payloadJSON struct {
	Payload       *string `json:"payload,omitempty"`
	PayloadBase64 []byte  `json:"payload_base64,omitempty"`
}

func newPayloadJSON(p []byte) payloadJSON {
	if utf8.Valid(p) {
		s := string(p)
		return payloadJSON{Payload: &s}
	}
	return payloadJSON{PayloadBase64: p}
}

// decode reads a delivery the way a settle consumer with the AMQP marshaler
// would, and picks out settle's failure metadata.
func decode(m amqpmarshal.Marshaler, d amqp091.Delivery) (entry, error) {
	msg, err := m.Unmarshal(d)
	if err != nil {
		return entry{}, fmt.Errorf("decode message %q: %w", d.MessageId, err)
	}
	md := msg.Metadata
	// The broker's view of this delivery (we are the ones redelivering it
	// when listing twice) says nothing about the message.
	delete(md, settle.MetaRedelivered)
	delete(md, settle.MetaDeliveryCount)
	e := entry{
		UUID:          msg.UUID,
		Outcome:       md.Get(settle.MetaOutcome),
		Reason:        md.Get(settle.MetaReason),
		OriginalTopic: md.Get(settle.MetaOriginalTopic),
		Handler:       md.Get(settle.MetaHandler),
		OriginalUUID:  md.Get(settle.MetaOriginalUUID),
		FirstFailure:  md.Get(settle.MetaFirstFailure),
		LastFailure:   md.Get(settle.MetaLastFailure),
		Metadata:      map[string]string(md),
		payloadJSON:   newPayloadJSON(msg.Payload),
		PayloadBytes:  len(msg.Payload),
	}
	if n, err := strconv.Atoi(md.Get(settle.MetaAttempt)); err == nil {
		e.Attempts = n
	}
	return e, nil
}

// listView is an entry without its payload, for list -json.
func (e entry) listView() entry {
	e.payloadJSON = payloadJSON{}
	return e
}

const reasonWidth = 60

// writeTable writes entries as an aligned table, one line each.
func writeTable(w io.Writer, entries []entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "UUID\tOUTCOME\tORIGINAL TOPIC\tHANDLER\tORIGINAL UUID\tATTEMPTS\tFIRST FAILURE\tLAST FAILURE\tREASON")
	for _, e := range entries {
		attempts := "-"
		if e.Attempts > 0 {
			attempts = strconv.Itoa(e.Attempts)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
			cell(e.UUID), cell(e.Outcome), cell(e.OriginalTopic), cell(e.Handler), cell(e.OriginalUUID),
			attempts, cell(e.FirstFailure), cell(e.LastFailure), cell(truncate(e.Reason, reasonWidth)))
	}
	return tw.Flush()
}

// writeDetail writes one entry in full, for show.
func writeDetail(w io.Writer, e entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	attempts := ""
	if e.Attempts > 0 {
		attempts = strconv.Itoa(e.Attempts)
	}
	rows := [][2]string{
		{"uuid", e.UUID},
		{"outcome", e.Outcome},
		{"reason", e.Reason},
		{"original topic", e.OriginalTopic},
		{"handler", e.Handler},
		{"original uuid", e.OriginalUUID},
		{"attempts", attempts},
		{"first failure", e.FirstFailure},
		{"last failure", e.LastFailure},
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s:\t%s\n", r[0], cell(r[1]))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "metadata:")
	for _, k := range slices.Sorted(maps.Keys(e.Metadata)) {
		fmt.Fprintf(w, "  %s: %s\n", oneLine(k), oneLine(e.Metadata[k]))
	}
	if e.Payload != nil {
		fmt.Fprintf(w, "payload (%d bytes):\n%s\n", e.PayloadBytes, safeText(*e.Payload))
	} else {
		fmt.Fprintf(w, "payload (%d bytes, not UTF-8, base64):\n%s\n", e.PayloadBytes, mustJSONString(e.PayloadBase64))
	}
	return nil
}

func mustJSONString(b []byte) string {
	s, _ := json.Marshal(b) // []byte encodes as a base64 string
	return strings.Trim(string(s), `"`)
}

// writeJSON writes v as indented JSON, with the characters a terminal may
// act on escaped (safeJSON): decoded, the strings are what they were.
func writeJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := w.Write(safeJSON(b.Bytes()))
	return err
}

func cell(s string) string {
	if s == "" {
		return "-"
	}
	return oneLine(s)
}

// oneLine keeps a value on one line of a table, safe for a terminal:
// newlines and tabs become spaces, other control characters are escaped
// (safeLine).
func oneLine(s string) string {
	return safeLine(strings.Map(func(r rune) rune {
		switch r {
		case '\n', '\r', '\t':
			return ' '
		}
		return r
	}, s))
}

// truncate shortens s to at most n runes, marking the cut with "...".
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-3]) + "..."
}
