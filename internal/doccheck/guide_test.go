package doccheck_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/otlptest"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

const guide = "../../docs/getting-started.md"

// snippet is one ```go block of the guide; file is the name given by a
// "<!-- file: NAME -->" line right above it, for the files of the guide's
// whole program, and empty for a snippet that stands alone.
type snippet struct {
	file, src string
}

var (
	block    = regexp.MustCompile("(?ms)^(?:<!-- file: ([A-Za-z0-9_./-]+) -->\n)?```go\n(.*?)^```")
	shBlock  = regexp.MustCompile("(?ms)^<!-- doccheck: ([a-z-]+) -->\n```sh\n(.*?)^```")
	readyLog = "welcome service running"
)

func snippets(t *testing.T) []snippet {
	t.Helper()
	doc, err := os.ReadFile(guide)
	if err != nil {
		t.Fatal(err)
	}
	var out []snippet
	for _, m := range block.FindAllStringSubmatch(string(doc), -1) {
		out = append(out, snippet{file: m[1], src: m[2]})
	}
	return out
}

// program returns the files of the guide's whole program, by name.
func program(t *testing.T) map[string]string {
	t.Helper()
	files := map[string]string{}
	for _, s := range snippets(t) {
		if s.file == "" {
			continue
		}
		if _, dup := files[s.file]; dup {
			t.Fatalf("the guide has two blocks for %s", s.file)
		}
		files[s.file] = s.src
	}
	if len(files) < 4 {
		t.Fatalf("found %d files of the whole program in the guide; it has more", len(files))
	}
	return files
}

// shCommands returns the commands of the guide's ```sh block marked
// "<!-- doccheck: name -->", without comments and blank lines.
func shCommands(t *testing.T, name string) []string {
	t.Helper()
	doc, err := os.ReadFile(guide)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range shBlock.FindAllStringSubmatch(string(doc), -1) {
		if m[1] != name {
			continue
		}
		var cmds []string
		for _, line := range strings.Split(m[2], "\n") {
			if i := strings.Index(line, "#"); i >= 0 {
				line = line[:i]
			}
			if line = strings.TrimSpace(line); line != "" {
				cmds = append(cmds, line)
			}
		}
		return cmds
	}
	t.Fatalf("the guide has no sh block marked <!-- doccheck: %s -->", name)
	return nil
}

// run runs a command line of plain words in dir.
func run(t *testing.T, dir string, env []string, line string) {
	t.Helper()
	words := strings.Fields(line)
	cmd := exec.Command(words[0], words[1:]...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s (in the throwaway module): %v\n%s", line, err, out)
	}
}

// The guide's install recipe and its whole program, as a newcomer would
// use them: a module of its own outside this repository, settle added by the
// documented replace recipe (there is no published version to go get), the
// program's files copied from the guide, built, and run against RabbitMQ
// and PostgreSQL. A good sign-up, one whose payload is not JSON (poison) and
// one whose e-mail always fails (dead-lettered after its attempts): the
// good one is recorded and its e-mail sent through the outbox and the
// relay, in one trace; the two others are parked, a row each in the
// program's parked-message table, and no copy is on a queue; SIGTERM stops
// the router and the relay, and the program exits 0.
//
// The program parks through the publisher settle recommends on RabbitMQ
// (amqpsub.Publisher): it logs no error at start about copies RabbitMQ
// could route to no queue, as it does for watermill-amqp's Publisher. Its
// relay publishes through the same publisher, which fails a row routed to
// no queue: a row left in the outbox before the program started (by an
// earlier run) is forwarded once its queue exists, without one failed
// publish, and nothing is pending or set aside at the end.
func TestGettingStartedService(t *testing.T) {
	t.Parallel()
	pgURL := testenv.Require(t, testenv.PostgresURLEnv)
	amqpURL := testenv.AMQPURL(t)
	pg := testenv.Postgres(t)
	recv := otlptest.New(t)

	name := testenv.Name(t, "gs")
	run8 := name[len(name)-8:]
	signedUp, welcome := "users.signed_up."+run8, "emails.welcome."+run8
	queues := []string{signedUp, welcome, signedUp + ".poison", signedUp + ".dead_letter", welcome + ".poison", welcome + ".dead_letter"}
	schema := "gs_" + run8
	if _, err := pg.ExecContext(t.Context(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pg.ExecContext(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		deleteQueues(amqpURL, queues)
	})
	sep := "?"
	if strings.Contains(pgURL, "?") {
		sep = "&"
	}
	dbURL := pgURL + sep + "search_path=" + schema
	appDB, err := sql.Open("pgx", dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer appDB.Close()
	// An e-mail requested by an earlier run and not yet forwarded: the
	// relay's first row, there before the program starts.
	ob, err := outbox.New(sqldb.Std(appDB, sqldb.Postgres), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	const leftOver = "welcome-eve@example.com"
	seedOutbox(t, appDB, ob, welcome, message.NewMessage(leftOver, []byte(`{"to":"eve@example.com"}`)))

	// The newcomer's module, beside a checkout of settle (here, this one).
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	parent := t.TempDir()
	if err := os.Symlink(root, filepath.Join(parent, "settle")); err != nil {
		t.Fatal(err)
	}
	mod := filepath.Join(parent, "welcome")
	if err := os.Mkdir(mod, 0o755); err != nil {
		t.Fatal(err)
	}
	for file, src := range program(t) {
		// Queues of its own, so that the test shares RabbitMQ with others.
		src = strings.ReplaceAll(src, `"users.signed_up"`, `"`+signedUp+`"`)
		src = strings.ReplaceAll(src, `"emails.welcome"`, `"`+welcome+`"`)
		if err := os.WriteFile(filepath.Join(mod, filepath.Base(file)), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// -mod=mod as a newcomer's go would; no go.work of the machine's.
	goEnv := []string{"GOFLAGS=" + strings.TrimSpace(os.Getenv("GOFLAGS")+" -mod=mod"), "GOWORK=off"}
	run(t, mod, goEnv, "go mod init example.com/welcome")
	for _, line := range shCommands(t, "replace") {
		if !strings.HasPrefix(line, "go ") {
			t.Fatalf("the replace recipe's command %q is not a go command: the test runs only those", line)
		}
		run(t, mod, goEnv, line)
	}
	run(t, mod, goEnv, "go build -o welcome .")
	gomod, _ := os.ReadFile(filepath.Join(mod, "go.mod"))
	if !strings.Contains(string(gomod), "github.com/settle-go/settle => ../settle") {
		t.Fatalf("the recipe left no replace directive in go.mod:\n%s", gomod)
	}

	cmd := exec.Command(filepath.Join(mod, "welcome"))
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+dbURL,
		"AMQP_URL="+amqpURL,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://"+recv.Endpoint(),
		"OTEL_SERVICE_NAME=welcome",
	)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(t.TempDir(), "welcome.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		once := false
		for sc.Scan() {
			_, _ = fmt.Fprintln(logf, sc.Text())
			if !once && strings.Contains(sc.Text(), readyLog) {
				once = true
				close(ready)
			}
		}
		exited <- cmd.Wait()
	}()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	logs := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	select {
	case <-ready:
	case err := <-exited:
		stopped = true
		t.Fatalf("the program exited before it was running: %v\n%s", err, logs())
	case <-time.After(60 * time.Second):
		t.Fatalf("the program did not log %q within 60s\n%s", readyLog, logs())
	}
	// The newcomer's path is the recommended one: no parking middleware
	// warned that its publisher cannot see a copy routed nowhere.
	if lines := unroutedWarnings(logs()); len(lines) > 0 {
		t.Errorf("at start the program logged %d error(s) about copies RabbitMQ routes to no queue: the guide's publisher is not amqpsub.Publisher\n%s",
			len(lines), strings.Join(lines, "\n"))
	}

	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for id, body := range map[string]string{
		"signup-ada": `{"email":"ada@example.com"}`,
		"signup-bad": `{"email": not json`,
		"signup-bob": `{"email":"bob@example.invalid"}`,
	} {
		conf, err := ch.PublishWithDeferredConfirm("", signedUp, true, false, amqp091.Publishing{
			MessageId: id, DeliveryMode: amqp091.Persistent, Body: []byte(body),
			Headers: amqp091.Table{"_watermill_message_uuid": id},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := conf.WaitContext(t.Context()); err != nil || !ok {
			t.Fatalf("publishing %s: confirmed %v, %v", id, ok, err)
		}
	}

	// The parked rows: the poison one at once, the dead letter after five
	// attempts and one redelivery; the message whole in each.
	store, err := parked.New(sqldb.Std(appDB, sqldb.Postgres), parked.Config{})
	if err != nil {
		t.Fatal(err)
	}
	poisonRow := waitForParked(t, store, "welcome", settle.Poisoned, 60*time.Second, logs)
	deadRow := waitForParked(t, store, "send-email", settle.DeadLettered, 90*time.Second, logs)
	if poisonRow.UUID != "signup-bad" || string(poisonRow.Payload) != `{"email": not json` || poisonRow.Topic != signedUp {
		t.Errorf("poisoned row: uuid %q, topic %q, payload %q", poisonRow.UUID, poisonRow.Topic, poisonRow.Payload)
	}
	if !strings.Contains(string(deadRow.Payload), "bob@example.invalid") || deadRow.Attempts != 5 || deadRow.TraceID == "" {
		t.Errorf("dead-lettered row: payload %q, %d attempts, trace %q", deadRow.Payload, deadRow.Attempts, deadRow.TraceID)
	}
	if n, err := store.Count(t.Context(), parked.Filter{}); err != nil || n != 2 {
		t.Errorf("%d parked rows (%v); want 2", n, err)
	}
	for _, q := range []string{signedUp + ".poison", welcome + ".dead_letter"} {
		// A channel per queue: a passive declaration of a queue that does
		// not exist (as here) closes it.
		qch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if st, err := qch.QueueDeclarePassive(q, true, false, false, false, nil); err == nil && st.Messages > 0 {
			t.Errorf("%d copies on %s; the program parks in its table only", st.Messages, q)
		}
		_ = qch.Close()
	}
	var welcomes int
	if err := pg.QueryRowContext(t.Context(), "SELECT count(*) FROM "+schema+".welcomes").Scan(&welcomes); err != nil {
		t.Fatal(err)
	}
	if welcomes != 2 {
		t.Errorf("%d rows in welcomes, want 2 (ada and bob; the poison message writes none)", welcomes)
	}
	// Every row the relay had, the left-over one first, was forwarded:
	// none pending, none set aside, no publish of a row failed.
	var st outbox.Status
	for deadline := time.Now().Add(60 * time.Second); ; {
		if st, err = ob.Status(t.Context()); err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 && st.SetAside == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if st.Pending != 0 || st.SetAside != 0 {
		t.Errorf("outbox: %d row(s) pending, %d set aside (%s)\n%s", st.Pending, st.SetAside, st.Explain(), logs())
	}
	for _, line := range strings.Split(logs(), "\n") {
		if strings.Contains(line, "outbox: publishing a row failed") {
			t.Errorf("the relay failed to publish a row: %s", line)
		}
	}

	// SIGTERM stops the router and the relay; the program flushes its
	// spans and exits 0.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		stopped = true
		if err != nil {
			t.Fatalf("after SIGTERM the program exited with %v\n%s", err, logs())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the program did not exit within 60s of SIGTERM\n%s", logs())
	}

	// One trace from the sign-up's delivery through the outbox and the
	// relay to the e-mail's delivery, although the program sets no
	// propagator.
	traces := map[string]map[string]bool{} // trace ID -> span names
	for _, sp := range recv.Spans() {
		id := fmt.Sprintf("%x", sp.GetTraceId())
		if traces[id] == nil {
			traces[id] = map[string]bool{}
		}
		traces[id][sp.GetName()] = true
	}
	whole := false
	for _, names := range traces {
		if names["process "+signedUp] && names["send "+welcome] && names["process "+welcome] {
			whole = true
		}
	}
	if !whole {
		t.Errorf("no trace holds process %s, send %s and process %s (%d spans in %d traces received)",
			signedUp, welcome, welcome, len(recv.Spans()), len(traces))
	}
	// The left-over e-mail was relayed and sent.
	sent := false
	for _, sp := range recv.Spans() {
		id, _ := otlptest.Attr(sp, "messaging.message.id")
		outcome, _ := otlptest.Attr(sp, "settle.outcome")
		if sp.GetName() == "process "+welcome && id == leftOver && outcome == "done" {
			sent = true
		}
	}
	if !sent {
		t.Errorf("no span process %s of message %s with settle.outcome done: the row left in the outbox before the start was not forwarded and handled\n%s",
			welcome, leftOver, logs())
	}
}

// unroutedWarnings returns the error-level lines of log that warn of a
// parking publisher that cannot see a copy RabbitMQ routed to no queue
// (middleware's warning for watermill-amqp's Publisher).
func unroutedWarnings(log string) []string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		l := strings.ToLower(line)
		if !strings.Contains(l, "level=error") {
			continue
		}
		if strings.Contains(l, "routes to no queue") || strings.Contains(l, "basic.return") ||
			strings.Contains(l, "amqpsub.newpublisher") || strings.Contains(l, "watermill-amqp's publisher") {
			out = append(out, line)
		}
	}
	return out
}

// seedOutbox creates the outbox's tables, as the program will, and commits
// msg to topic in the outbox.
func seedOutbox(t *testing.T, db *sql.DB, ob *outbox.Outbox[*sql.Tx], topic string, msg *message.Message) {
	t.Helper()
	for _, s := range ob.Schema() {
		if _, err := db.ExecContext(t.Context(), s); err != nil {
			t.Fatal(err)
		}
	}
	tx, err := db.BeginTx(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := ob.TxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// waitForParked returns the row of handler with outcome within d, or fails.
func waitForParked(t *testing.T, store *parked.Store[*sql.Tx], handler string, outcome settle.Outcome, d time.Duration, logs func() string) parked.Message {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		page, err := store.List(t.Context(), parked.Query{Filter: parked.Filter{Handler: handler, Outcome: outcome}})
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Messages) > 0 {
			return page.Messages[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s row of %s within %v: the message was not parked\n%s", outcome, handler, d, logs())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// deleteQueues deletes the test's queues, those that exist.
func deleteQueues(url string, queues []string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	for _, q := range queues {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		_, _ = ch.QueueDelete(q, false, false, false)
		_ = ch.Close()
	}
}
