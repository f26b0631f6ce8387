package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestThreeDeliveriesOneEffect(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	db := filepath.Join(t.TempDir(), "app.db")
	if err := run(t.Context(), config{DB: db}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	got := out.String()
	if n := strings.Count(got, "  acked\n"); n != 3 {
		t.Errorf("acked deliveries = %d, want 3\n%s", n, got)
	}
	if n := strings.Count(got, "handler: welcome e-mail sent to user-42"); n != 1 {
		t.Errorf("handler runs = %d, want 1\n%s", n, got)
	}
	if !strings.Contains(got, "deliveries: 3, welcome e-mails sent: 1\n") {
		t.Errorf("summary missing:\n%s", got)
	}
}

func TestRefusesBadInput(t *testing.T) {
	t.Parallel()
	if err := run(t.Context(), config{DB: filepath.Join(t.TempDir(), "app.db"), Deliveries: -1}, &bytes.Buffer{}); err == nil {
		t.Fatal("run with -deliveries -1 succeeded")
	}
}
