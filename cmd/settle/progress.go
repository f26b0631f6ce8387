package main

import (
	"fmt"
	"io"
	"time"
)

// progress prints a status line to w at most once per interval, so that a
// long operation shows it is moving. An interval <= 0 prints nothing.
type progress struct {
	w        io.Writer
	interval time.Duration
	last     time.Time
	now      func() time.Time
}

func newProgress(w io.Writer, interval time.Duration) *progress {
	return &progress{w: w, interval: interval, last: time.Now(), now: time.Now}
}

// tick prints the line when the interval has passed since the last one.
func (p *progress) tick(format string, args ...any) {
	if p.interval <= 0 {
		return
	}
	if now := p.now(); now.Sub(p.last) >= p.interval {
		p.last = now
		fmt.Fprintf(p.w, format+"\n", args...)
	}
}
