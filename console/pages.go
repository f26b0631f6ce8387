package console

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/jsonsize"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
)

// view is what every page's template receives.
type view struct {
	Title    string
	Base     string // Config.BasePath
	Nav      string // the page, for the navigation bar
	CSRF     string
	ReadOnly bool
	Claims   bool // the claims page exists
	LoggedIn bool // a login session: show "log out"
	Data     any
}

func parsePages() (map[string]*template.Template, error) {
	names := []string{"login", "error", "groups", "messages", "message", "confirm", "result", "activity", "outbox", "claims"}
	pages := make(map[string]*template.Template, len(names))
	for _, n := range names {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+n+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", n, err)
		}
		pages[n] = t
	}
	return pages, nil
}

var funcs = template.FuncMap{
	"when": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.UTC().Format("2006-01-02 15:04:05") + " UTC"
	},
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return age(time.Since(t))
	},
	"dur":   age,
	"short": func(s string, n int) string { return shorten(s, n) },
}

// age says a duration as a person would: 3s, 4m, 2h 5m, 3d 4h.
func age(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh %dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd %dh", int(d.Hours())/24, int(d.Hours())%24)
}

// shorten cuts s to about n runes, on a rune boundary, and marks the cut.
func shorten(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n]) + "…"
}

// render writes page with data; a failed template is a 500 with no
// partial page.
func (s *server[TTx]) render(w http.ResponseWriter, r *http.Request, code int, page, title string, data any) {
	sess := sessionFrom(r.Context())
	v := view{
		Title: title, Base: s.cfg.BasePath, Nav: page, ReadOnly: s.cfg.ReadOnly,
		Claims: s.cfg.Claims != nil, LoggedIn: s.cfg.Token != "" && sess != "" && sess != bearerSession,
		Data: data,
	}
	if sess != "" {
		v.CSRF = s.csrf(sess)
	}
	var b bytes.Buffer
	if err := s.pages[page].Execute(&b, v); err != nil {
		s.cfg.Logger.Error("console: render", err, watermill.LogFields{"page": page})
		http.Error(w, "the page could not be drawn", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write(b.Bytes())
}

// refuse answers a request the console will not serve.
func (s *server[TTx]) refuse(w http.ResponseWriter, r *http.Request, code int, msg string) {
	if r.Method != http.MethodGet {
		s.cfg.Logger.Info("console: refused", watermill.LogFields{"method": r.Method, "path": shorten(r.URL.EscapedPath(), 100), "status": code, "why": msg})
	}
	s.render(w, r, code, "error", http.StatusText(code), msg)
}

// fail answers a request a store could not serve.
func (s *server[TTx]) fail(w http.ResponseWriter, r *http.Request, what string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	if errors.Is(err, parked.ErrInvalid) { // a forged cursor, say
		s.refuse(w, r, http.StatusBadRequest, err.Error())
		return
	}
	s.cfg.Logger.Error("console: "+what, err, nil)
	s.render(w, r, http.StatusInternalServerError, "error", "Error", what+": "+err.Error())
}

// badRequest is a filter or form the console cannot read.
type badRequest string

func (e badRequest) Error() string { return string(e) }

// filterOf reads the list filter from the query.
func filterOf(q url.Values) (parked.Filter, error) {
	f := parked.Filter{
		Handler: strings.TrimSpace(q.Get("handler")),
		Topic:   strings.TrimSpace(q.Get("topic")),
		Group:   strings.TrimSpace(q.Get("group")),
		Reason:  q.Get("reason"),
		UUID:    strings.TrimSpace(q.Get("uuid")),
		Key:     strings.TrimSpace(q.Get("key")),
	}
	switch o := settle.Outcome(q.Get("outcome")); o {
	case "", settle.DeadLettered, settle.Poisoned:
		f.Outcome = o
	default:
		return f, badRequest("outcome: want dead_lettered or poisoned")
	}
	switch st := parked.State(q.Get("state")); st {
	case "", parked.StateParked, parked.StateReplayed, parked.StateArchived:
		f.State = st
	default:
		return f, badRequest("state: want parked, replayed or archived")
	}
	var err error
	if f.Since, err = timeOf(q.Get("since")); err != nil {
		return f, badRequest("since: " + err.Error())
	}
	if f.Until, err = timeOf(q.Get("until")); err != nil {
		return f, badRequest("until: " + err.Error())
	}
	return f, nil
}

// timeOf reads a time of a form: what an <input type=datetime-local>
// sends (taken as UTC), or RFC 3339.
func timeOf(v string) (time.Time, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{"2006-01-02T15:04", "2006-01-02T15:04:05", time.RFC3339Nano, "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, v, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, errors.New("want a time like 2026-12-01T15:04 (UTC)")
}

// filterQuery writes f back as a query, for links that keep the filter.
func filterQuery(f parked.Filter) url.Values {
	q := url.Values{}
	set := func(k, v string) {
		if v != "" {
			q.Set(k, v)
		}
	}
	set("handler", f.Handler)
	set("topic", f.Topic)
	set("group", f.Group)
	set("reason", f.Reason)
	set("uuid", f.UUID)
	set("key", f.Key)
	set("outcome", string(f.Outcome))
	set("state", string(f.State))
	if !f.Since.IsZero() {
		set("since", f.Since.UTC().Format("2006-01-02T15:04"))
	}
	if !f.Until.IsZero() {
		set("until", f.Until.UTC().Format("2006-01-02T15:04"))
	}
	return q
}

// groups is the front page: the failure groups.
func (s *server[TTx]) groups(w http.ResponseWriter, r *http.Request) {
	f, err := filterOf(r.URL.Query())
	if err != nil {
		s.refuse(w, r, http.StatusBadRequest, err.Error())
		return
	}
	gs, err := s.cfg.Parked.Groups(r.Context(), parked.Filter{Handler: f.Handler, Outcome: f.Outcome})
	if err != nil {
		s.fail(w, r, "listing the groups", err)
		return
	}
	var parkedN, total int64
	for _, g := range gs {
		parkedN += g.Parked
		total += g.Total
	}
	s.render(w, r, http.StatusOK, "groups", "Failure groups", struct {
		Groups        []parked.Group
		Filter        parked.Filter
		Parked, Total int64
	}{gs, f, parkedN, total})
}

// messages is the filtered, keyset-paginated list.
func (s *server[TTx]) messages(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterOf(q)
	if err != nil {
		s.refuse(w, r, http.StatusBadRequest, err.Error())
		return
	}
	limit := 50
	if l, err := strconv.Atoi(q.Get("limit")); err == nil && l > 0 && l <= 500 {
		limit = l
	}
	page, err := s.cfg.Parked.List(r.Context(), parked.Query{Filter: f, Cursor: q.Get("cursor"), Limit: limit})
	if err != nil {
		s.fail(w, r, "listing the messages", err)
		return
	}
	fq := filterQuery(f)
	next := ""
	if page.Next != "" {
		nq := filterQuery(f)
		nq.Set("cursor", page.Next)
		if limit != 50 {
			nq.Set("limit", strconv.Itoa(limit))
		}
		next = s.cfg.BasePath + "/messages?" + nq.Encode()
	}
	first := ""
	if q.Get("cursor") != "" {
		first = s.cfg.BasePath + "/messages?" + fq.Encode()
	}
	s.render(w, r, http.StatusOK, "messages", "Parked messages", struct {
		Messages    []parked.Message
		Filter      parked.Filter
		Since       string
		Until       string
		Next, First string
	}{page.Messages, f, fq.Get("since"), fq.Get("until"), next, first})
}

// metaItem is one metadata entry, in key order.
type metaItem struct{ Key, Value string }

// message is one parked message.
func (s *server[TTx]) message(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		s.refuse(w, r, http.StatusNotFound, "no such message")
		return
	}
	m, err := s.cfg.Parked.Get(r.Context(), id)
	if errors.Is(err, parked.ErrNotFound) {
		s.refuse(w, r, http.StatusNotFound, "no such message")
		return
	}
	if err != nil {
		s.fail(w, r, "reading the message", err)
		return
	}
	kind, body := payloadText(m.Payload)
	meta := make([]metaItem, 0, len(m.Metadata))
	for _, k := range slices.Sorted(maps.Keys(m.Metadata)) {
		meta = append(meta, metaItem{k, m.Metadata[k]})
	}
	s.render(w, r, http.StatusOK, "message", "Message "+strconv.FormatInt(id, 10), struct {
		M           parked.Message
		PayloadKind string
		Payload     string
		Size        int
		Meta        []metaItem
		TraceLink   string
	}{m, kind, body, len(m.Payload), meta, s.traceLink(m.TraceID)})
}

// maxShown is the most payload bytes a message page shows.
const maxShown = 256 << 10

// payloadText returns how the payload is shown: JSON indented, text as
// it is, anything else as a hex dump; cut at maxShown.
func payloadText(p []byte) (kind, text string) {
	cut := ""
	if len(p) > maxShown {
		cut = fmt.Sprintf("\n… %d more bytes not shown", len(p)-maxShown)
	}
	if len(p) <= 4*maxShown && json.Valid(p) && jsonsize.IndentedSize(p) <= maxIndented {
		var b bytes.Buffer
		if err := json.Indent(&b, p, "", "  "); err == nil {
			if b.Len() > maxShown {
				return "JSON", shortenBytes(b.Bytes()) + fmt.Sprintf("\n… cut at %d bytes", maxShown)
			}
			return "JSON", b.String()
		}
	}
	shown := p[:min(len(p), maxShown)]
	if utf8.Valid(shown) || utf8.Valid(shown[:max(0, len(shown)-3)]) && len(p) > maxShown {
		return "text", shortenBytes(shown) + cut
	}
	return "binary", hex.Dump(shown[:min(len(shown), 16<<10)]) + cut
}

// maxIndented is the most bytes json.Indent may write for a payload page:
// deep nesting multiplies a payload (44 KB of "[[[…0,0,0…]]]" is 590 MiB
// indented), so the page does not indent one whose jsonsize.IndentedSize is
// larger.
const maxIndented = 16 * maxShown

// shortenBytes returns the first maxShown bytes as a string, cut on a rune
// boundary.
func shortenBytes(b []byte) string {
	if len(b) > maxShown {
		b = b[:maxShown]
	}
	for len(b) > 0 && !utf8.Valid(b) {
		b = b[:len(b)-1]
	}
	return string(b)
}

// traceLink is the Jaeger link of a trace id, "" when there is no Jaeger
// or the id is not one (32 hex digits).
func (s *server[TTx]) traceLink(id string) string {
	if s.cfg.TraceURL == "" || len(id) != 32 {
		return ""
	}
	if _, err := hex.DecodeString(id); err != nil {
		return ""
	}
	return strings.TrimSuffix(s.cfg.TraceURL, "/") + "/trace/" + id
}

// selection is what an action acts on: some rows by id, or a group.
type selection struct {
	Action string // "replay" or "archive"
	IDs    []int64
	Group  string
	Until  time.Time // a group is pinned to the rows that failed before
	Topic  string    // replay to this topic instead of the original
	Force  bool      // past the loop guard
}

// maxSelected is the most ids one action takes.
const maxSelected = 1000

func selectionOf(v url.Values, now time.Time) (selection, error) {
	sel := selection{Action: v.Get("action"), Group: strings.TrimSpace(v.Get("group")),
		Topic: strings.TrimSpace(v.Get("topic")), Force: v.Get("force") == "1"}
	if sel.Action != "replay" && sel.Action != "archive" {
		return sel, badRequest("action: want replay or archive")
	}
	ids := v["id"]
	if len(ids) > maxSelected {
		return sel, badRequest(fmt.Sprintf("at most %d messages at once", maxSelected))
	}
	for _, s := range ids {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id <= 0 {
			return sel, badRequest("id: not a message id")
		}
		sel.IDs = append(sel.IDs, id)
	}
	switch {
	case len(sel.IDs) == 0 && sel.Group == "":
		return sel, badRequest("nothing selected: tick some messages, or pick a group")
	case len(sel.IDs) > 0 && sel.Group != "":
		return sel, badRequest("either messages or a group, not both")
	}
	if sel.Group != "" {
		if u := v.Get("until"); u != "" {
			t, err := time.Parse(time.RFC3339Nano, u)
			if err != nil {
				return sel, badRequest("until: not a time")
			}
			sel.Until = t
		} else {
			sel.Until = now
		}
	}
	return sel, nil
}

func (sel selection) filter() parked.Filter {
	return parked.Filter{IDs: sel.IDs, Group: sel.Group, Until: sel.Until, State: parked.StateParked}
}

func (sel selection) describe() string {
	switch {
	case sel.Group != "":
		return "a group's parked messages"
	case len(sel.IDs) == 1:
		return "message " + strconv.FormatInt(sel.IDs[0], 10)
	}
	return fmt.Sprintf("%d selected messages", len(sel.IDs))
}

// destination is one line of a preview.
type destination struct {
	Topic string
	N     int64
}

// confirm shows what an action will do, and the form that does it.
func (s *server[TTx]) confirm(w http.ResponseWriter, r *http.Request) {
	sel, err := selectionOf(r.URL.Query(), s.now())
	if err != nil {
		s.refuse(w, r, http.StatusBadRequest, err.Error())
		return
	}
	data := struct {
		Sel          selection
		What         string
		Group        *parked.Group
		Until        string
		Preview      parked.ReplayResult
		Destinations []destination
		Archive      int64
		Nothing      bool
	}{Sel: sel, What: sel.describe()}
	if sel.Group != "" {
		gs, err := s.cfg.Parked.Groups(r.Context(), parked.Filter{})
		if err != nil {
			s.fail(w, r, "reading the group", err)
			return
		}
		for i := range gs {
			if gs[i].ID == sel.Group {
				data.Group = &gs[i]
			}
		}
	}
	if !sel.Until.IsZero() {
		data.Until = sel.Until.UTC().Format(time.RFC3339Nano)
	}
	if sel.Action == "replay" {
		res, err := s.cfg.Parked.Preview(r.Context(), sel.filter(), parked.ReplayOptions{Topic: sel.Topic, By: s.cfg.By, Force: sel.Force})
		if err != nil {
			s.fail(w, r, "previewing the replay", err)
			return
		}
		data.Preview, data.Destinations = res, destinations(res.Destinations)
		data.Nothing = res.Replayed == 0
	} else {
		n, err := s.cfg.Parked.Count(r.Context(), sel.filter())
		if err != nil {
			s.fail(w, r, "counting the messages", err)
			return
		}
		data.Archive, data.Nothing = n, n == 0
	}
	s.render(w, r, http.StatusOK, "confirm", "Confirm: "+sel.Action, data)
}

func destinations(m map[string]int64) []destination {
	out := make([]destination, 0, len(m))
	for _, t := range slices.Sorted(maps.Keys(m)) {
		out = append(out, destination{t, m[t]})
	}
	return out
}

// act does what a confirmation page asked for.
func (s *server[TTx]) act(w http.ResponseWriter, r *http.Request) {
	sel, err := selectionOf(r.PostForm, s.now())
	if err != nil {
		s.refuse(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if sel.Group != "" && r.PostForm.Get("until") == "" {
		s.refuse(w, r, http.StatusBadRequest, "until: a group's action is pinned by its confirmation page")
		return
	}
	data := struct {
		Sel          selection
		What         string
		Result       parked.ReplayResult
		Destinations []destination
		Archived     int64
	}{Sel: sel, What: sel.describe()}
	fields := watermill.LogFields{"action": sel.Action, "ids": len(sel.IDs), "group": sel.Group, "topic": sel.Topic, "force": sel.Force}
	if sel.Action == "replay" {
		res, err := s.cfg.Parked.Replay(r.Context(), s.cfg.Outbox, sel.filter(), parked.ReplayOptions{Topic: sel.Topic, By: s.cfg.By, Force: sel.Force})
		if err != nil {
			s.fail(w, r, "replaying", err)
			return
		}
		data.Result, data.Destinations = res, destinations(res.Destinations)
		fields["replayed"], fields["refused"], fields["skipped"] = res.Replayed, res.Refused, res.Skipped
	} else {
		n, err := s.cfg.Parked.Archive(r.Context(), sel.filter(), s.cfg.By)
		if err != nil {
			s.fail(w, r, "archiving", err)
			return
		}
		data.Archived = n
		fields["archived"] = n
	}
	s.cfg.Logger.Info("console: "+sel.Action, fields)
	s.render(w, r, http.StatusOK, "result", "Done: "+sel.Action, data)
}

// bar is one hour of the activity chart.
type bar struct {
	Start        time.Time
	Dead, Poison int64
	X            int    // left edge, px
	Label        string // the hour, under some bars
	HDead, HPoi  int    // heights, px
	YDead, YPoi  int    // top edges, px
}

// activity shows the parked rows per hour by outcome (per three or six
// hours over three days or a week).
func (s *server[TTx]) activity(w http.ResponseWriter, r *http.Request) {
	hours := 24
	if h, err := strconv.Atoi(r.URL.Query().Get("hours")); err == nil && h >= 1 && h <= 168 {
		hours = h
	}
	// Two counts per bar: 24 bars of an hour, or at most 24 of three hours,
	// or 28 of six.
	per := 1
	switch {
	case hours > 72:
		per = 6
	case hours > 24:
		per = 3
	}
	hours = (hours + per - 1) / per * per
	span := time.Duration(per) * time.Hour
	end := s.now().UTC().Truncate(time.Hour).Add(time.Hour)
	bars := make([]bar, hours/per)
	var peak, dead, poison int64
	for i := range bars {
		b := &bars[i]
		b.Start = end.Add(-time.Duration(len(bars)-i) * span)
		for _, o := range []settle.Outcome{settle.DeadLettered, settle.Poisoned} {
			n, err := s.cfg.Parked.Count(r.Context(), parked.Filter{Outcome: o, Since: b.Start, Until: b.Start.Add(span)})
			if err != nil {
				s.fail(w, r, "counting the messages", err)
				return
			}
			if o == settle.DeadLettered {
				b.Dead, dead = n, dead+n
			} else {
				b.Poison, poison = n, poison+n
			}
		}
		peak = max(peak, b.Dead+b.Poison)
	}
	const height, width = 160, 720
	step := width / len(bars)
	for i := range bars {
		b := &bars[i]
		b.X = i * step
		if peak > 0 {
			b.HDead = int(b.Dead * height / peak)
			b.HPoi = int(b.Poison * height / peak)
		}
		b.YDead = height - b.HDead
		b.YPoi = b.YDead - b.HPoi
		if i%max(1, len(bars)/8) == 0 {
			if hours > 24 {
				b.Label = b.Start.Format("Jan 2 15:04")
			} else {
				b.Label = b.Start.Format("15:04")
			}
		}
	}
	s.render(w, r, http.StatusOK, "activity", "Activity", struct {
		Bars               []bar
		Hours, Per         int
		Peak, Dead, Poison int64
		Step, BarW, Height int
		Width              int
		From, To           time.Time
	}{bars, hours, per, peak, dead, poison, step, max(1, step-2), height, width, end.Add(-time.Duration(hours) * time.Hour), end})
}

// outboxPage shows the outbox's backlog and its rows set aside.
func (s *server[TTx]) outboxPage(w http.ResponseWriter, r *http.Request) {
	st, err := s.cfg.Outbox.Status(r.Context())
	if err != nil {
		s.fail(w, r, "reading the outbox status", err)
		return
	}
	rows, err := s.cfg.Outbox.Failed(r.Context(), outbox.Selection{SetAsideOnly: true, Limit: 100})
	if err != nil {
		s.fail(w, r, "listing the rows set aside", err)
		return
	}
	s.render(w, r, http.StatusOK, "outbox", "Outbox", struct {
		S       outbox.Status
		Explain string
		Rows    []outbox.FailedRow
	}{st, st.Explain(), rows})
}

// claims shows the claims in flight and looks up one key.
func (s *server[TTx]) claims(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	data := struct {
		InFlight   []dedupe.KeyState
		Oldest     time.Duration
		Scope, Key string
		Asked      bool
		Found      bool
		State      dedupe.KeyState
	}{Scope: q.Get("scope"), Key: q.Get("key")}
	if data.Scope != "" || data.Key != "" {
		st, found, err := s.cfg.Claims.Lookup(r.Context(), data.Scope, data.Key)
		if err != nil {
			s.fail(w, r, "looking the key up", err)
			return
		}
		data.Asked, data.Found, data.State = true, found, st
	}
	fl, err := s.cfg.Claims.InFlight(r.Context(), 100)
	if err != nil {
		s.fail(w, r, "listing the claims in flight", err)
		return
	}
	data.InFlight = fl
	if len(fl) > 0 && !fl[0].Updated.IsZero() {
		data.Oldest = s.now().Sub(fl[0].Updated)
	}
	s.render(w, r, http.StatusOK, "claims", "Claims", data)
}
