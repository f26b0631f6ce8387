package middleware_test

import (
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

// refusingPublisher refuses every message carrying the metadata key refuse,
// as a broker refuses a frame it cannot take, and keeps what it accepted.
type refusingPublisher struct {
	refuse string
	mu     sync.Mutex
	tries  int
	got    []*message.Message
}

func (p *refusingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.tries++
	for _, m := range msgs {
		if _, ok := m.Metadata[p.refuse]; ok {
			return errors.New("frame too large")
		}
	}
	p.got = append(p.got, msgs...)
	return nil
}

func (p *refusingPublisher) Close() error { return nil }

// A copy whose full form the broker refuses is parked, after
// park.MinimalAfter failed publishes, as a minimal copy that names what it
// left out; until then the delivery is deferred, never acked.
func TestParkMinimalCopyAfterRepeatedFailures(t *testing.T) {
	t.Parallel()
	pub := &refusingPublisher{refuse: "x-odd"}
	mw, err := middleware.NewPoison(middleware.ParkConfig{Publisher: pub, Topic: "poison", NackDelay: settle.NoDelay})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(func(*message.Message) ([]*message.Message, error) {
		return nil, poison.Permanent(errors.New("bad"))
	})
	var errs []error
	for range 4 { // the first delivery and three redeliveries
		msg := message.NewMessage("m-1", []byte("payload"))
		msg.Metadata.Set("x-odd", "refused by the broker")
		msg.Metadata.Set("keep", "v")
		_, err := h(msg)
		errs = append(errs, err)
	}
	for i, err := range errs[:3] {
		if err == nil {
			t.Fatalf("delivery %d acked while its copy was refused", i+1)
		}
	}
	if errs[3] != nil {
		t.Fatalf("fourth delivery: %v, want parked with a minimal copy", errs[3])
	}
	if len(pub.got) != 1 {
		t.Fatalf("%d copies published, want 1", len(pub.got))
	}
	cp := pub.got[0]
	if cp.UUID != "m-1" || string(cp.Payload) != "payload" || cp.Metadata.Get(settle.MetaOutcome) != string(settle.Poisoned) {
		t.Errorf("minimal copy %s %q %v", cp.UUID, cp.Payload, cp.Metadata)
	}
	var dropped struct {
		Count int      `json:"count"`
		Names []string `json:"names"`
	}
	if err := json.Unmarshal([]byte(cp.Metadata.Get(middleware.MetaDroppedHeaders)), &dropped); err != nil {
		t.Fatalf("%s: %v", middleware.MetaDroppedHeaders, err)
	}
	if dropped.Count != 2 || strings.Join(dropped.Names, ",") != "keep,x-odd" || cp.Metadata.Get("keep") != "" {
		t.Errorf("dropped %+v, metadata %v; want keep and x-odd left out and named", dropped, cp.Metadata)
	}
}

// A copy's metadata stays within MaxMetadataBytes: the original's largest
// entries are left out first, the small ones kept, and the reason is cut,
// as valid UTF-8.
func TestParkCopyBounds(t *testing.T) {
	t.Parallel()
	pub := &refusingPublisher{refuse: "never"}
	mw, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: "dead", NackDelay: settle.NoDelay})
	if err != nil {
		t.Fatal(err)
	}
	reason := strings.Repeat("é", 10<<10) + "\xff"
	h := mw(func(*message.Message) ([]*message.Message, error) {
		return nil, &middleware.ExhaustedError{Err: errors.New(reason), Attempts: 3}
	})
	msg := message.NewMessage("m-2", nil)
	msg.Metadata.Set("big-1", strings.Repeat("a", 40<<10))
	msg.Metadata.Set("big-2", strings.Repeat("b", 30<<10))
	msg.Metadata.Set("small", "s")
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	cp := pub.got[0]
	size := len(cp.UUID)
	for k, v := range cp.Metadata {
		size += len(k) + len(v)
	}
	if size > 64<<10 {
		t.Errorf("copy metadata %d bytes, want <= 64 KiB", size)
	}
	if cp.Metadata.Get("big-1") != "" || cp.Metadata.Get("big-2") == "" || cp.Metadata.Get("small") != "s" {
		t.Errorf("kept big-1 %d, big-2 %d, small %q; want only the largest left out",
			len(cp.Metadata.Get("big-1")), len(cp.Metadata.Get("big-2")), cp.Metadata.Get("small"))
	}
	r := cp.Metadata.Get(settle.MetaReason)
	if len(r) > 4<<10 || !strings.HasSuffix(r, "bytes cut]") || !utf8Valid(r) {
		t.Errorf("reason %d bytes, valid UTF-8 %v, ends %q", len(r), utf8Valid(r), r[max(0, len(r)-20):])
	}
}

func utf8Valid(s string) bool { return strings.ToValidUTF8(s, "") == s }

// Messages without a UUID do not share a count: a dead-lettered one does
// not use up the attempts of the next, and a good one does not erase a
// failing one's. (Found by the hostile-input campaign: a good message with
// no id was dead-lettered without a run.)
func TestRetryCountsMessagesWithoutUUIDApart(t *testing.T) {
	t.Parallel()
	rt, err := middleware.NewRetry(middleware.RetryConfig{MaxAttempts: 2, NoInProcessRetries: true, RedeliveryDelay: settle.NoDelay})
	if err != nil {
		t.Fatal(err)
	}
	runs := map[string]int{}
	h := rt(func(msg *message.Message) ([]*message.Message, error) {
		runs[string(msg.Payload)]++
		if string(msg.Payload) == "good" {
			return nil, nil
		}
		return nil, errors.New("fails")
	})
	deliver := func(payload string) error {
		_, err := h(message.NewMessage("", []byte(payload)))
		return err
	}
	var ex *middleware.ExhaustedError
	if err := deliver("bad"); err == nil || errors.As(err, &ex) {
		t.Fatalf("first run of bad: %v, want a retry", err)
	}
	if err := deliver("good"); err != nil {
		t.Fatalf("good: %v", err)
	}
	if err := deliver("bad"); !errors.As(err, &ex) {
		t.Fatalf("second run of bad: %v, want exhausted (a good message erased its count)", err)
	}
	if err := deliver("other"); err == nil || errors.As(err, &ex) || runs["other"] != 1 {
		t.Fatalf("another message without a UUID: %v after %d runs, want a run and a retry", err, runs["other"])
	}
}

// flakyInitializer fails its first fail declarations.
type flakyInitializer struct{ fail, calls int }

func (f *flakyInitializer) SubscribeInitialize(string) error {
	f.calls++
	if f.calls <= f.fail {
		return errors.New("broker unreachable")
	}
	return nil
}

// A park that failed because its topic could not be declared says nothing
// of the copy: it does not bring the minimal copy nearer.
func TestParkFailedDeclarationsDoNotMakeTheCopyMinimal(t *testing.T) {
	t.Parallel()
	pub := &refusingPublisher{refuse: "x-odd"}
	decl := &flakyInitializer{fail: 5}
	mw, err := middleware.NewPoison(middleware.ParkConfig{Publisher: pub, Initializer: decl, Topic: "poison", NackDelay: settle.NoDelay})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(func(*message.Message) ([]*message.Message, error) {
		return nil, poison.Permanent(errors.New("bad"))
	})
	for i := 1; i <= 9; i++ {
		msg := message.NewMessage("m-3", []byte("payload"))
		msg.Metadata.Set("x-odd", "refused by the broker")
		_, err := h(msg)
		if (i < 9) != (err != nil) {
			t.Fatalf("delivery %d: %v (publishes tried %d)", i, err, pub.tries)
		}
	}
	if decl.calls != 9 || pub.tries != 4 || len(pub.got) != 1 || pub.got[0].Metadata.Get(middleware.MetaDroppedHeaders) == "" {
		t.Fatalf("%d declarations, %d publishes, %d copies; want 9, 4 (three full, one minimal), 1 minimal", decl.calls, pub.tries, len(pub.got))
	}
}
