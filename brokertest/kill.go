package brokertest

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/sqldb"
)

// childEnv turns a re-executed test binary into the kill case's consumer;
// its value is the JSON of a childSpec.
const childEnv = "SETTLE_BROKERTEST_CHILD"

// Phases the child writes in its status file.
const (
	phaseReady   = "ready"
	phaseHandler = "mid-handler " // followed by the message's UUID
)

// childSpec is what the kill case's child needs: the test that calls Run
// (the child runs only it), and the case's names.
type childSpec struct {
	Test   string `json:"test"`
	Topic  string `json:"topic"`
	Dead   string `json:"dead"`
	Poison string `json:"poison"`
	Claims string `json:"claims"`
	Fx     string `json:"fx"`
	Status string `json:"status"`
}

func childSpecFrom(env string) (childSpec, bool) {
	var s childSpec
	if env == "" || json.Unmarshal([]byte(env), &s) != nil || s.Test == "" {
		return childSpec{}, false
	}
	return s, true
}

// runPattern is the -test.run pattern that selects exactly the test named
// name (a test or a subtest path) and none of its siblings.
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

// testKill: a consumer process is killed with SIGKILL while its handler
// runs in the claim's transaction, its effect written and not committed;
// a second consumer then gets the message from the broker and does the
// work, once: the dead process's effect was rolled back with its
// transaction, and the message is acked by the second consumer.
func testKill(f *fixture) {
	t := f.t
	if f.h.InProcess {
		t.Skip("brokertest: Harness.InProcess: the broker dies with the process, so no message outlives a kill")
	}
	status := f.t.TempDir() + "/status"
	if err := os.WriteFile(status, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	spec, err := json.Marshal(childSpec{Test: f.parent, Topic: f.topic, Dead: f.dead, Poison: f.poison, Claims: f.claims, Fx: f.fx, Status: status})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*wait)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run="+runPattern(f.parent), "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("brokertest: start the child consumer: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	phase := func() string {
		b, _ := os.ReadFile(status)
		return strings.TrimSpace(string(b))
	}
	waitPhase := func(want string) {
		t.Helper()
		deadline := time.After(wait)
		for phase() != want {
			select {
			case err := <-exited:
				t.Fatalf("brokertest: the child consumer exited (%v) before %q; its output:\n%s", err, want, out.String())
			case <-deadline:
				_ = cmd.Process.Kill()
				<-exited
				t.Fatalf("brokertest: the child consumer did not reach %q within %v (at %q); its output:\n%s", want, wait, phase(), out.String())
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	waitPhase(phaseReady)
	id := watermill.NewUUID()
	f.publish(id, order(id))
	waitPhase(phaseHandler + id)
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatalf("brokertest: kill the child consumer: %v", err)
	}
	<-exited
	if fx := f.effects(id); fx != 0 {
		t.Fatalf("the killed consumer's uncommitted effect is visible: %d effects", fx)
	}
	c := f.startConsumer(modeTx)
	f.waitFor("the second consumer done with the message", func() (bool, string) { return f.count(f.acks, id) >= 1, f.state(id) })
	time.Sleep(settleGrace)
	if runs, fx, mine := f.count(f.runs, id), f.effects(id), f.effectsBy(id, os.Getpid()); runs != 1 || fx != 1 || mine != 1 {
		t.Errorf("after the kill: the second consumer ran %d times, %d effects (%d its own); want 1, 1, 1 (%s)", runs, fx, mine, f.state(id))
	}
	f.drained(c)
}

// runChild is Run in the kill case's child process: it consumes the case's
// topic with the suite's transactional handler, which writes its effect,
// says so in the status file and waits to be killed.
func runChild(t *testing.T, setup func(t *testing.T) Harness, spec childSpec) {
	h := setup(t)
	if err := h.validate(); err != nil {
		t.Fatal(err)
	}
	if h.Logger == nil {
		h.Logger = watermill.NopLogger{}
	}
	setPhase := func(p string) {
		if err := os.WriteFile(spec.Status, []byte(p), 0o600); err != nil {
			t.Errorf("brokertest child: %v", err)
		}
	}
	store, err := dedupe.NewSQLStore(sqldb.Std(h.DB, h.Dialect), dedupe.SQLConfig{Table: spec.Claims})
	if err != nil {
		t.Fatal(err)
	}
	insert := "INSERT INTO " + spec.Fx + " (msg_id, pid) VALUES (" + ph(h.Dialect, 1) + ", " + ph(h.Dialect, 2) + ")"
	pid := os.Getpid()
	hs := handlers{tx: func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		if _, err := tx.ExecContext(ctx, insert, msg.UUID, pid); err != nil {
			return err
		}
		setPhase(phaseHandler + msg.UUID)
		<-ctx.Done() // until killed
		return ctx.Err()
	}}
	c, err := buildConsumer(t, h, nil, store, spec.Topic, spec.Dead, spec.Poison, modeTx, hs)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	setPhase(phaseReady)
	time.Sleep(2 * wait)
	c.stop(t)
	t.Fatalf("brokertest child: not killed within %v", 2*wait)
}
