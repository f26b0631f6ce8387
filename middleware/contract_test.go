package middleware_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
)

// The cases of the package documentation's "Assembling the stack by hand":
// each middleware missing or out of its place either works as documented
// or says so in an error log.

// chain composes mws around h, the first outermost.
func chain(h message.HandlerFunc, mws ...message.HandlerMiddleware) message.HandlerFunc {
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// loggedError reports whether log has an error-level entry whose message
// contains text.
func loggedError(log *watermill.CaptureLoggerAdapter, text string) int {
	n := 0
	for _, m := range log.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(m.Msg, text) {
			n++
		}
	}
	return n
}

func deadLetter(t *testing.T, pub message.Publisher) message.HandlerMiddleware {
	t.Helper()
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pub, Topic: deadTopic, Initializer: noInit{}})
	must(t, err)
	return dl
}

type noInit struct{}

func (noInit) SubscribeInitialize(string) error { return nil }

func newDedupe(t *testing.T, log watermill.LoggerAdapter) message.HandlerMiddleware {
	t.Helper()
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: dedupe.NewMemoryStore(), Logger: log})
	must(t, err)
	return dd
}

// StoreCounts set with no dedupe middleware inside: a failed run no store
// counted is logged, and counted by the retry middleware itself, so that
// MaxAttempts still bounds the runs.
func TestContractStoreCountsWithoutDedupe(t *testing.T) {
	t.Parallel()
	log := watermill.NewCaptureLogger()
	cfg := fastRetry(3, 0)
	cfg.StoreCounts, cfg.Logger = true, log
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	parked := &countingPublisher{}
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) { runs++; return nil, errFlaky }, deadLetter(t, parked), rt)
	for range 6 {
		if _, err := h(message.NewMessage("m", nil)); err == nil {
			break // parked and acked
		}
	}
	if runs != 3 || parked.n.Load() != 1 {
		t.Fatalf("%d runs, %d parked; want 3 runs (MaxAttempts), then the dead-letter", runs, parked.n.Load())
	}
	if loggedError(log, "misassembled") == 0 {
		t.Fatalf("no error logged for StoreCounts without a store: %v", log.Captured())
	}
}

// The dedupe middleware inside a retry middleware without StoreCounts: the
// dedupe middleware logs it once, and both count: a delivery whose broker
// count alone says its runs are used up is dead-lettered without a run.
func TestContractDedupeWithoutStoreCounts(t *testing.T) {
	t.Parallel()
	log := watermill.NewCaptureLogger()
	rt, err := middleware.NewRetry(fastRetry(5, 1))
	must(t, err)
	parked := &countingPublisher{}
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil }, deadLetter(t, parked), rt, newDedupe(t, log))
	for i, m := range []*message.Message{quorumDelivery(t, "m-1", 1), quorumDelivery(t, "m-2", 4), quorumDelivery(t, "m-3", 1)} {
		if _, err := h(m); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if runs != 2 || parked.n.Load() != 1 {
		t.Fatalf("%d runs, %d parked; want m-2 dead-lettered without a run, the others run", runs, parked.n.Load())
	}
	if n := loggedError(log, "StoreCounts"); n != 1 {
		t.Fatalf("%d error logs naming StoreCounts, want 1: %v", n, log.Captured())
	}
}

// StoreInside with the dedupe middleware inside: a delivery whose broker
// count leaves no attempt is looked up, not dead-lettered on the count: a
// duplicate when its key is confirmed, dead-lettered without a run when it
// is not.
func TestContractStoreInsideDedupe(t *testing.T) {
	t.Parallel()
	cfg := fastRetry(5, 1)
	cfg.StoreInside = true
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	parked := &countingPublisher{}
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil }, deadLetter(t, parked), rt, newDedupe(t, nil))
	for i, m := range []*message.Message{quorumDelivery(t, "m-1", 1), quorumDelivery(t, "m-1", 4), quorumDelivery(t, "m-2", 4)} {
		if _, err := h(m); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if runs != 1 || parked.n.Load() != 1 {
		t.Fatalf("%d runs, %d parked; want m-1 run once and acked as a duplicate, m-2 dead-lettered without a run", runs, parked.n.Load())
	}
}

// StoreInside with no store inside: the delivery with no attempt left runs
// once more, and the retry middleware logs it.
func TestContractStoreInsideWithoutStore(t *testing.T) {
	t.Parallel()
	log := watermill.NewCaptureLogger()
	cfg := fastRetry(5, 1)
	cfg.StoreInside, cfg.Logger = true, log
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	parked := &countingPublisher{}
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) { runs++; return nil, errFlaky }, deadLetter(t, parked), rt)
	if _, err := h(quorumDelivery(t, "m-1", 4)); err != nil {
		t.Fatal(err)
	}
	if runs != 1 || parked.n.Load() != 1 {
		t.Fatalf("%d runs, %d parked; want the one run, then the dead-letter", runs, parked.n.Load())
	}
	if loggedError(log, "misassembled") == 0 {
		t.Fatalf("no error logged for StoreInside without a store: %v", log.Captured())
	}
}

// The dedupe middleware outside the retry middleware: logged; the
// in-process retries run under the delivery's one claim.
func TestContractDedupeOutsideRetry(t *testing.T) {
	t.Parallel()
	log := watermill.NewCaptureLogger()
	cfg := fastRetry(5, 2)
	cfg.Logger = log
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	var attempts []int
	h := chain(func(m *message.Message) ([]*message.Message, error) {
		attempts = append(attempts, settle.SettlementFromContext(m.Context()).Attempt())
		if len(attempts) < 3 {
			return nil, errFlaky
		}
		return nil, nil
	}, deadLetter(t, &countingPublisher{}), newDedupe(t, nil), rt)
	if _, err := h(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	if len(attempts) != 3 || attempts[2] != 3 {
		t.Fatalf("attempts %v; want 3 runs counted by the retry middleware", attempts)
	}
	if loggedError(log, "misassembled") != 1 {
		t.Fatalf("no error logged for dedupe outside retry: %v", log.Captured())
	}
}

// No retry middleware: the dedupe store's count is the attempt, and nothing
// bounds it.
func TestContractNoRetry(t *testing.T) {
	t.Parallel()
	log := watermill.NewCaptureLogger()
	var attempts []int
	h := chain(func(m *message.Message) ([]*message.Message, error) {
		attempts = append(attempts, settle.SettlementFromContext(m.Context()).Attempt())
		return nil, errFlaky
	}, deadLetter(t, &countingPublisher{}), newDedupe(t, log))
	for range 7 {
		if _, err := h(message.NewMessage("m", nil)); !errors.Is(err, errFlaky) {
			t.Fatalf("err %v, want the handler's", err)
		}
	}
	if len(attempts) != 7 || attempts[6] != 7 {
		t.Fatalf("attempts %v, want 1..7", attempts)
	}
	if n := len(log.Captured()[watermill.ErrorLogLevel]); n != 0 {
		t.Fatalf("%d error logs, want none", n)
	}
}

// No dead-letter parking: the *ExhaustedError is the delivery's result (the
// router nacks it), and every redelivery is refused at once, without a run.
func TestContractNoDeadLetter(t *testing.T) {
	t.Parallel()
	cfg := fastRetry(2, 0)
	cfg.StoreCounts = true
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: &countingPublisher{}, Topic: poisonTopic, Initializer: noInit{}})
	must(t, err)
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) { runs++; return nil, errFlaky }, ps, rt, newDedupe(t, nil))
	var ex *middleware.ExhaustedError
	for i := range 4 {
		_, err := h(message.NewMessage("m", nil))
		if exhausted := errors.As(err, &ex); exhausted != (i >= 1) {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if runs != 2 {
		t.Fatalf("%d runs, want 2 (MaxAttempts)", runs)
	}
}

// No poison parking, behind the dedupe middleware: a permanent error is the
// delivery's result, each redelivery an attempt, and the message is
// dead-lettered once MaxAttempts are spent.
func TestContractNoPoison(t *testing.T) {
	t.Parallel()
	cfg := fastRetry(3, 2)
	cfg.StoreCounts = true
	rt, err := middleware.NewRetry(cfg)
	must(t, err)
	parked := &countingPublisher{}
	runs := 0
	h := chain(func(*message.Message) ([]*message.Message, error) {
		runs++
		return nil, &dedupe.KeyError{Err: errFlaky} // permanent
	}, deadLetter(t, parked), rt, newDedupe(t, nil))
	for i := range 5 {
		_, err := h(message.NewMessage("m", nil))
		if err == nil {
			break
		}
		if !settle.IsPermanent(err) {
			t.Fatalf("delivery %d: %v, want the permanent error", i+1, err)
		}
	}
	if runs != 3 || parked.n.Load() != 1 {
		t.Fatalf("%d runs, %d parked; want one run per delivery, dead-lettered after 3", runs, parked.n.Load())
	}
}
