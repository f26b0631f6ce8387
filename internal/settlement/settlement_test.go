package settlement_test

import (
	"context"
	"errors"
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
	if n, sc := nilRec.Limit(); nilRec.Deferred() || n != 0 || sc {
		t.Fatal("a nil record recorded something")
	}
	_, r := settlement.New(context.Background(), nil)
	r.SetLimit(3, true)
	r.Count(2)
	r.Defer()
	if o, _, _, _ := r.Snapshot(); o != settlement.Deferred || !r.Deferred() {
		t.Fatalf("outcome %q after Defer", o)
	}
	r.BeginRun()
	n, sc := r.Limit()
	if a, counted, _ := r.Attempt(); r.Deferred() || counted || a != 0 || n != 3 || !sc {
		t.Fatal("BeginRun kept the last run's state or lost the delivery's")
	}
}

type otherKey struct{}

// The record's context finds the record, passes other values and the
// parent's cancellation through, and Ensure reuses it.
func TestNewContext(t *testing.T) {
	t.Parallel()
	parent, cancel := context.WithCancelCause(context.WithValue(t.Context(), otherKey{}, "v"))
	ctx, r := settlement.New(parent, nil)
	if settlement.FromContext(ctx) != r || settlement.FromContext(parent) != nil {
		t.Fatal("the record is not found in its context only")
	}
	if ctx.Value(otherKey{}) != "v" {
		t.Fatal("a parent's value is lost")
	}
	if _, got, created := settlement.Ensure(ctx); got != r || created {
		t.Fatal("Ensure made a second record")
	}
	child, stop := context.WithCancel(ctx)
	defer stop()
	errStop := errors.New("stop")
	cancel(errStop)
	if !errors.Is(ctx.Err(), context.Canceled) || !errors.Is(child.Err(), context.Canceled) || !errors.Is(context.Cause(child), errStop) {
		t.Fatalf("after the parent's cancellation: Err %v, child Err %v, cause %v", ctx.Err(), child.Err(), context.Cause(child))
	}
}
