package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestEveryInvoiceEndsInOnePlace(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	if err := run(t.Context(), config{}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	got := out.String()
	for _, want := range []string{
		`inv-1  done +after 1 attempt`,
		`inv-2  done +after 2 attempt`,
		`inv-3  done +after 3 attempt`,
		`inv-4  poison topic +after 1 attempt`,
		`inv-5  dead-letter topic +after 3 attempt`,
	} {
		if n := len(regexp.MustCompile(want).FindAllString(got, -1)); n != 1 {
			t.Errorf("%q found %d times, want once\n%s", want, n, got)
		}
	}

	// The dead-letter copy says why, from where and when.
	_, dead, ok := strings.Cut(got, "dead-letter topic copy of inv-5:\n")
	if !ok {
		t.Fatalf("no dead-letter copy printed:\n%s", got)
	}
	for _, want := range []string{
		`settle_attempt +3\n`,
		`settle_outcome +dead_lettered\n`,
		`settle_reason +smtp: 421 try again later \(invoice inv-5, attempt 3\)\n`,
		`settle_original_topic +invoices\n`,
		`settle_original_uuid +inv-5\n`,
		`settle_handler +send-invoice\n`,
		`settle_first_failure_at +\d{4}-\d\d-\d\dT[\d:.]+Z\n`,
		`settle_last_failure_at +\d{4}-\d\d-\d\dT[\d:.]+Z\n`,
	} {
		if !regexp.MustCompile(want).MatchString(dead) {
			t.Errorf("dead-letter copy lacks %q:\n%s", want, dead)
		}
	}
	_, pois, ok := strings.Cut(got, "poison topic copy of inv-4:\n")
	if !ok || !regexp.MustCompile(`settle_outcome +poisoned\n`).MatchString(pois) ||
		!regexp.MustCompile(`settle_reason +permanent: invoice inv-4 has no customer e-mail address\n`).MatchString(pois) {
		t.Errorf("poison copy missing or wrong:\n%s", got)
	}
}
