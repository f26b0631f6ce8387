package pipeline

import (
	"testing"
	"time"
)

// A leader's timer is set early by the batcher's learned timer lateness, so
// that the estimate must follow the lateness seen, stay within half of the
// wait, and fall again when timers fire on time.
func TestWakeLateFollowsTheTimers(t *testing.T) {
	const wait = 2 * time.Millisecond
	var avg time.Duration
	for range 40 {
		avg = wakeLate(avg, 300*time.Microsecond, wait)
	}
	if avg < 290*time.Microsecond || avg > 300*time.Microsecond {
		t.Fatalf("after 40 timers 300µs late the estimate is %v, want about 300µs", avg)
	}
	for range 40 {
		avg = wakeLate(avg, time.Nanosecond, wait)
	}
	if avg > 10*time.Microsecond {
		t.Fatalf("after 40 timers on time the estimate is %v, want about 0", avg)
	}
	for range 40 {
		avg = wakeLate(avg, 50*time.Millisecond, wait)
	}
	if avg != wait/2 {
		t.Fatalf("timers 50ms late: the estimate is %v, want it capped at half the wait, %v", avg, wait/2)
	}
	// One late timer among punctual ones moves it by an eighth.
	if got := wakeLate(0, 800*time.Microsecond, wait); got != 100*time.Microsecond {
		t.Fatalf("one timer 800µs late: %v, want 100µs", got)
	}
}
