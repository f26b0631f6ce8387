package main

import (
	"bytes"
	"context"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestCommittedOrdersArePublishedRolledBackOnesAreNot(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	if err := run(t.Context(), config{DB: filepath.Join(t.TempDir(), "shop.db")}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	got := out.String()
	for _, want := range []string{
		`"A-1".* -> 201 Created\n`,
		`"A-2".* -> 201 Created\n`,
		`"A-3".* -> 409 Conflict order A-3: not enough stock`,
		`"A-4".* -> 400 Bad Request`,
		`consumer: order A-1 placed, 2 x mug\n`,
		`consumer: order A-2 placed, 3 x mug\n`,
		`orders in the database: 2, events forwarded by the relay: 2\n`,
	} {
		if n := len(regexp.MustCompile(want).FindAllString(got, -1)); n != 1 {
			t.Errorf("%q found %d times, want once\n%s", want, n, got)
		}
	}
	if n := strings.Count(got, "consumer:"); n != 2 {
		t.Errorf("consumer printed %d events, want 2 (A-3 rolled back, A-4 refused)\n%s", n, got)
	}
}

func TestServe(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, config{DB: filepath.Join(t.TempDir(), "shop.db"), Serve: true, Addr: "127.0.0.1:0"}, out)
	}()

	var url string
	waitFor(t, out, done, func(s string) bool {
		m := regexp.MustCompile(`listening on (http://\S+)`).FindStringSubmatch(s)
		if m != nil {
			url = m[1]
		}
		return m != nil
	})
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Post(url+"/orders", "application/json", strings.NewReader(`{"id":"S-1","sku":"mug","qty":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /orders: %s", resp.Status)
	}
	waitFor(t, out, done, func(s string) bool { return strings.Contains(s, "consumer: order S-1 placed, 1 x mug") })

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run after interrupt: %v\n%s", err, out.String())
	}
}

// waitFor polls the output until cond holds, failing if run returns first.
func waitFor(t *testing.T, out *syncBuffer, done chan error, cond func(string) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond(out.String()) {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("run returned early: %v\n%s", err, out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met in time; output:\n%s", out.String())
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
