package integration_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// runRouter runs r in the background and returns once it is running. The
// returned stop closes r and waits up to wait for Run to return, reporting
// errors on t; it may be called twice and is also called when the test ends.
func runRouter(t *testing.T, r *message.Router, wait time.Duration) (stop func()) {
	t.Helper()
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			if err := r.Close(); err != nil {
				t.Errorf("close router: %v", err)
			}
			select {
			case err := <-runErr:
				if err != nil {
					t.Errorf("router run: %v", err)
				}
			case <-time.After(wait):
				t.Error("router did not stop")
			}
		})
	}
	t.Cleanup(stop)
	select {
	case <-r.Running():
	case err := <-runErr:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(wait):
		t.Fatal("router did not start")
	}
	return stop
}
