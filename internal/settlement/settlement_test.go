package settlement_test

import (
	"context"
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/settlement"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A pipeline handler's competing subscriptions share one scope; other names
// are their own.
func TestScope(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"charge": "charge", "charge#2": "charge", "charge#17": "charge",
		"charge#": "charge#", "#2": "#2", "a#b": "a#b", "a#2#3": "a#2", "": "",
	} {
		if got := settlement.ScopeOf(name); got != want {
			t.Errorf("Scope(%q) = %q, want %q", name, got, want)
		}
	}
}

// A deferral is undone by the next run; nil records are no-ops.
func TestRecord(t *testing.T) {
	t.Parallel()
	var nilRec *settlement.Record
	nilRec.Defer()
	nilRec.Count(3)
	if nilRec.Deferred() || nilRec.Limit() != 0 {
		t.Fatal("a nil record recorded something")
	}
	_, r := settlement.New(context.Background(), nil)
	r.SetLimit(3)
	r.Count(2)
	r.Defer()
	if o, _, _, _ := r.Snapshot(); o != settlement.Deferred || !r.Deferred() {
		t.Fatalf("outcome %q after Defer", o)
	}
	r.BeginRun()
	if a, counted, _ := r.Attempt(); r.Deferred() || counted || a != 0 || !r.Durable() || r.Limit() != 3 {
		t.Fatal("BeginRun kept the last run's state or lost the delivery's")
	}
}
