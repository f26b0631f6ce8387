package integration_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/settle-go/settle/amqpmarshal"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

// obWait bounds each outbox test on RabbitMQ, and every wait inside it.
const obWait = 90 * time.Second

// obEnv is one test's outbox on a real database, relayed into one RabbitMQ
// queue: the outbox's own tables, a business table written in the same
// transactions, and the destination queue.
type obEnv struct {
	t         *testing.T
	db        testenv.DB
	ob        *outbox.Outbox[*sql.Tx]
	biz       string // business table, one row per transaction
	url       string
	queue     string // the destination topic of every outbox message
	ch        *amqp091.Channel
	marshaler amqpmarshal.Marshaler
}

func newOBEnv(t *testing.T, db testenv.DB) *obEnv {
	t.Helper()
	e := &obEnv{t: t, db: db, url: testenv.AMQPURL(t), queue: testenv.Name(t, "obq")}
	name := testenv.Name(t, "ob")
	suffix := name[len(name)-8:]
	topic := "obx_" + suffix
	ob, err := outbox.New(sqldb.Std(db.DB, sqldb.Dialect(db.Dialect)), outbox.Config{Topic: topic})
	saMust(t, err)
	e.ob = ob
	saMust(t, ob.InitSchema(t.Context()))
	e.biz = "obbiz_" + suffix
	t.Cleanup(func() {
		for _, tbl := range []string{e.biz, obQuote(db, topic), obQuote(db, topic+"_relays")} {
			if _, err := db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+tbl); err != nil {
				t.Errorf("drop %s: %v", tbl, err)
			}
		}
	})
	_, err = db.ExecContext(t.Context(), "CREATE TABLE "+e.biz+" (id VARCHAR(64) PRIMARY KEY)")
	saMust(t, err)

	e.marshaler, err = amqpmarshal.New(amqpmarshal.Config{})
	saMust(t, err)
	conn, err := amqp091.Dial(e.url)
	saMust(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	e.ch, err = conn.Channel()
	saMust(t, err)
	// Registered after the connection's cleanup, so it runs before it; and
	// before any publisher, subscriber or relay is started, so it runs after
	// they stopped.
	t.Cleanup(func() {
		if _, err := e.ch.QueueDelete(e.queue, false, false, false); err != nil {
			t.Errorf("delete queue %s: %v", e.queue, err)
		}
	})
	// The publisher routes by queue name and declares nothing: the queue
	// must exist before the first forward.
	_, err = e.ch.QueueDeclare(e.queue, true, false, false, false, nil)
	saMust(t, err)
	return e
}

func obQuote(db testenv.DB, s string) string {
	if db.Dialect == sqldb.MySQL {
		return "`" + s + "`"
	}
	return `"` + s + `"`
}

func obPH(db testenv.DB, n int) string {
	if db.Dialect == sqldb.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func (e *obEnv) amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(e.url)
	cfg.Marshaler = e.marshaler
	cfg.Publish.ConfirmDelivery = true
	return cfg
}

// newPublisher is a RabbitMQ publisher with publisher confirms: a forward
// returns only once the broker holds the message.
func (e *obEnv) newPublisher() *amqp.Publisher {
	e.t.Helper()
	pub, err := amqp.NewPublisher(e.amqpConfig(), testenv.AMQPLogger(e.t, nil))
	saMust(e.t, err)
	e.t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			e.t.Errorf("close publisher: %v", err)
		}
	})
	return pub
}

// obMessages returns n new messages with distinct UUIDs and payloads.
func obMessages(n int, tag string) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"tx":%q,"line":%d}`, tag, i))
		msgs[i].Metadata.Set("tx", tag)
	}
	return msgs
}

// placeTx writes one business row and publishes msgs to the queue through
// the outbox, in one transaction that it commits or rolls back. It is safe
// to call from any goroutine.
func (e *obEnv) placeTx(ctx context.Context, id string, commit bool, msgs []*message.Message) (err error) {
	tx, err := e.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil || !commit {
			err = errors.Join(err, tx.Rollback())
		}
	}()
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+e.biz+" (id) VALUES ("+obPH(e.db, 1)+")", id); err != nil {
		return err
	}
	pub, err := e.ob.TxPublisher(tx)
	if err != nil {
		return err
	}
	if err := pub.Publish(e.queue, msgs...); err != nil {
		return err
	}
	if commit {
		return tx.Commit()
	}
	return nil
}

func (e *obEnv) countRows(table string) int {
	e.t.Helper()
	var n int
	saMust(e.t, e.db.QueryRowContext(e.t.Context(), "SELECT COUNT(*) FROM "+table).Scan(&n))
	return n
}

func (e *obEnv) pending(ctx context.Context) int64 {
	e.t.Helper()
	st, err := e.ob.Status(ctx)
	saMust(e.t, err)
	return st.Pending
}

// obRelay is a relay running in this process.
type obRelay struct {
	*outbox.Relay
	done chan error
	once sync.Once
	err  error
}

// startRelay runs a relay of the default consumer group into out until
// stop (also called at cleanup).
func (e *obEnv) startRelay(ctx context.Context, out message.Publisher) *obRelay {
	e.t.Helper()
	r, err := e.ob.NewRelay(out, outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	saMust(e.t, err)
	rl := &obRelay{Relay: r, done: make(chan error, 1)}
	go func() { rl.done <- r.Run(ctx) }()
	e.t.Cleanup(func() {
		if err := rl.stop(); err != nil {
			e.t.Errorf("relay: %v", err)
		}
	})
	select {
	case <-r.Running():
	case err := <-rl.done:
		rl.done <- err
		e.t.Fatalf("relay stopped before running: %v", err)
	case <-ctx.Done():
		e.t.Fatalf("relay did not start: %v", ctx.Err())
	}
	return rl
}

// stop closes the relay (waiting for the forward in progress) and returns
// the error of Close and Run. It may be called twice.
func (r *obRelay) stop() error {
	r.once.Do(func() { r.err = errors.Join(r.Close(), <-r.done) })
	return r.err
}

// waitQueue polls the queue, which nobody consumes, until it holds exactly
// n ready messages.
func (e *obEnv) waitQueue(ctx context.Context, n int) {
	e.t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		q, err := e.ch.QueueDeclarePassive(e.queue, true, false, false, false, nil)
		if err != nil {
			e.t.Fatalf("inspect queue %s: %v", e.queue, err)
		}
		if q.Messages == n {
			return
		}
		select {
		case <-ctx.Done():
			e.t.Fatalf("queue %s holds %d messages, want %d: %v", e.queue, q.Messages, n, ctx.Err())
		case <-tick.C:
		}
	}
}

// obDelivery is one delivery as the consumer's outermost middleware saw it
// settle.
type obDelivery struct {
	uuid   string
	err    error         // nil: acked
	result dedupe.Result // the dedupe middleware's claim; 0 if it took none
}

// obConsumer consumes the queue with settle's stack: the dedupe middleware
// with a PostgreSQL SQLStore, then pipeline.NewTxHandler, whose transaction
// writes one effect row per message and confirms the claim.
type obConsumer struct {
	e       *obEnv
	effects string
	router  *message.Router
	runErr  chan error

	mu         sync.Mutex
	deliveries []obDelivery
}

func (e *obEnv) startConsumer() *obConsumer {
	t := e.t
	t.Helper()
	if e.db.Dialect != sqldb.Postgres {
		t.Fatal("the consumer's effects and claims live in PostgreSQL")
	}
	c := &obConsumer{e: e, effects: testenv.Name(t, "obfx")}
	_, err := e.db.ExecContext(t.Context(), `CREATE TABLE "`+c.effects+`" (message_uuid text NOT NULL, payload text NOT NULL)`)
	saMust(t, err)
	t.Cleanup(func() { _, _ = e.db.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+c.effects+`"`) })
	store, err := dedupe.NewSQLStore(e.db.Driver(), dedupe.SQLConfig{Table: testenv.DedupeTable(t, e.db)})
	saMust(t, err)
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
	saMust(t, err)
	h, err := pipeline.NewTxHandler(pipeline.TxConfig[*sql.Tx]{DB: e.db.Driver()}, func(ctx context.Context, tx *sql.Tx, msg *message.Message, _ message.Publisher) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO "`+c.effects+`" (message_uuid, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload))
		return err
	})
	saMust(t, err)

	sub, err := amqp.NewSubscriber(e.amqpConfig(), testenv.AMQPLogger(t, nil))
	saMust(t, err)
	t.Cleanup(func() {
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
	})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: obWait}, watermill.NopLogger{})
	saMust(t, err)
	r.AddConsumerHandler("outbox_effect", e.queue, sub, func(msg *message.Message) error {
		err := h(msg)
		return err
	}).AddMiddleware(c.observe, dd)
	c.router = r
	c.runErr = make(chan error, 1)
	go func() { c.runErr <- r.Run(context.Background()) }()
	t.Cleanup(c.stop)
	select {
	case <-r.Running():
	case err := <-c.runErr:
		t.Fatalf("consumer stopped before running: %v", err)
	case <-time.After(obWait):
		t.Fatal("consumer did not start")
	}
	return c
}

// observe is the outermost middleware: it records how each delivery settled
// and what the dedupe middleware's claim said.
func (c *obConsumer) observe(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		d := obDelivery{uuid: msg.UUID, err: err}
		if claim, ok := dedupe.ClaimFromContext(msg.Context()); ok {
			d.result = claim.Result
		}
		c.mu.Lock()
		c.deliveries = append(c.deliveries, d)
		c.mu.Unlock()
		return out, err
	}
}

func (c *obConsumer) snapshot() []obDelivery {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]obDelivery(nil), c.deliveries...)
}

// acked returns the acked deliveries.
func (c *obConsumer) acked() []obDelivery {
	var out []obDelivery
	for _, d := range c.snapshot() {
		if d.err == nil {
			out = append(out, d)
		}
	}
	return out
}

// waitAcked polls until n deliveries were acked, then stops the router and
// checks that the queue is empty. More than n acks fails the test.
func (c *obConsumer) waitAcked(ctx context.Context, n int) []obDelivery {
	t := c.e.t
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for len(c.acked()) < n {
		select {
		case <-ctx.Done():
			t.Fatalf("%d deliveries acked, want %d: %v", len(c.acked()), n, ctx.Err())
		case <-tick.C:
		}
	}
	c.stop()
	if left := saQueueAfterConsumersLeft(t, c.e.ch, c.e.queue, nil); left != 0 {
		t.Errorf("queue %s holds %d messages after the consumer, want 0", c.e.queue, left)
	}
	acked := c.acked()
	if len(acked) != n {
		t.Errorf("%d deliveries acked, want exactly %d (the copies RabbitMQ held)", len(acked), n)
	}
	return acked
}

// stop closes the router and waits for Run. It may be called twice.
func (c *obConsumer) stop() {
	if c.router.IsClosed() {
		return
	}
	if err := c.router.Close(); err != nil {
		c.e.t.Errorf("close consumer: %v", err)
	}
	if err := <-c.runErr; err != nil {
		c.e.t.Errorf("consumer run: %v", err)
	}
}

// effects returns the effect rows, and how many distinct messages they are
// for.
func (c *obConsumer) effectRows() (rows, distinct int) {
	t := c.e.t
	t.Helper()
	saMust(t, c.e.db.QueryRowContext(t.Context(), `SELECT COUNT(*), COUNT(DISTINCT message_uuid) FROM "`+c.effects+`"`).Scan(&rows, &distinct))
	return rows, distinct
}

// TestOutboxAMQPCommitForwardsOnce: messages published through the outbox in
// a committed transaction reach RabbitMQ exactly once each, unchanged;
// those of a rolled-back transaction never do.
func TestOutboxAMQPCommitForwardsOnce(t *testing.T) {
	t.Parallel()
	for _, d := range []struct {
		name string
		open func(testing.TB) testenv.DB
	}{
		{"postgres", testenv.Postgres},
		{"mysql", testenv.MySQL},
	} {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), obWait)
			defer cancel()
			e := newOBEnv(t, d.open(t))
			start := time.Now()

			rolledBack := obMessages(5, "rolled-back")
			if err := e.placeTx(ctx, "order-rolled-back", false, rolledBack); err != nil {
				t.Fatal(err)
			}
			committed := obMessages(20, "committed")
			if err := e.placeTx(ctx, "order-committed", true, committed); err != nil {
				t.Fatal(err)
			}
			if n := e.countRows(e.biz); n != 1 {
				t.Fatalf("%d business rows, want the committed one", n)
			}
			if p := e.pending(ctx); p != 20 {
				t.Fatalf("%d outbox rows pending, want the committed 20", p)
			}

			relay := e.startRelay(ctx, e.newPublisher())
			if err := relay.Drain(ctx); err != nil {
				t.Fatal(err)
			}
			if err := relay.stop(); err != nil {
				t.Fatal(err)
			}
			if fwd, failed := relay.Counts(); fwd != 20 || failed != 0 {
				t.Errorf("relay counts forwarded=%d failed=%d, want 20 and 0", fwd, failed)
			}

			e.waitQueue(ctx, 20)
			got := saDrain(t, e.ch, e.marshaler, e.queue)
			t.Logf("%s: 20 messages committed, forwarded and read back in %v", d.name, time.Since(start).Round(time.Millisecond))
			want := map[string]*message.Message{}
			for _, m := range committed {
				want[m.UUID] = m
			}
			never := map[string]bool{}
			for _, m := range rolledBack {
				never[m.UUID] = true
			}
			seen := map[string]int{}
			for _, m := range got {
				seen[m.UUID]++
				if never[m.UUID] {
					t.Errorf("message %s of the rolled-back transaction reached RabbitMQ", m.UUID)
					continue
				}
				w, ok := want[m.UUID]
				if !ok {
					t.Errorf("unexpected message %s %q", m.UUID, m.Payload)
					continue
				}
				if string(m.Payload) != string(w.Payload) || m.Metadata.Get("tx") != "committed" {
					t.Errorf("message %s: payload %q tx=%q, want %q tx=committed", m.UUID, m.Payload, m.Metadata.Get("tx"), w.Payload)
				}
			}
			for id := range want {
				if seen[id] != 1 {
					t.Errorf("message %s arrived %d times, want once", id, seen[id])
				}
			}
			if len(got) != 20 {
				t.Errorf("%d messages on the queue, want 20", len(got))
			}
			if p := e.pending(ctx); p != 0 {
				t.Errorf("%d outbox rows still pending", p)
			}
		})
	}
}

// TestOutboxAMQPTwoRelaysOneEffectEach: two relays of one consumer group
// forward 500 messages, committed in 50 concurrent transactions while they
// run, into one queue. None is lost; duplicates (if any) are counted, and the
// consumer's dedupe absorbs them: exactly one effect row per message.
func TestOutboxAMQPTwoRelaysOneEffectEach(t *testing.T) {
	t.Parallel()
	const (
		txs       = 50
		perTx     = 10
		total     = txs * perTx
		producers = 5
	)
	ctx, cancel := context.WithTimeout(t.Context(), obWait)
	defer cancel()
	e := newOBEnv(t, testenv.Postgres(t))
	start := time.Now()
	c := e.startConsumer()
	relays := []*obRelay{e.startRelay(ctx, e.newPublisher()), e.startRelay(ctx, e.newPublisher())}

	want := map[string]string{}
	batches := make([][]*message.Message, txs)
	for i := range batches {
		batches[i] = obMessages(perTx, fmt.Sprintf("tx-%d", i))
		for _, m := range batches[i] {
			want[m.UUID] = string(m.Payload)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, txs)
	for p := range producers {
		wg.Go(func() {
			for i := p; i < txs; i += producers {
				if err := e.placeTx(ctx, fmt.Sprintf("order-%d", i), true, batches[i]); err != nil {
					errs <- fmt.Errorf("transaction %d: %w", i, err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	published := time.Since(start)

	if err := relays[0].Drain(ctx); err != nil {
		t.Fatal(err)
	}
	// Closing waits for a forward in progress: after it, every copy the
	// relays put on RabbitMQ is counted in forwarded.
	var forwarded [2]int64
	for i, r := range relays {
		if err := r.stop(); err != nil {
			t.Fatal(err)
		}
		fwd, failed := r.Counts()
		if failed != 0 {
			t.Errorf("relay %d: %d failed forwards, want 0", i+1, failed)
		}
		forwarded[i] = fwd
	}
	drained := time.Since(start)
	sum := forwarded[0] + forwarded[1]
	if sum < total {
		t.Fatalf("relays forwarded %d + %d = %d, want >= %d", forwarded[0], forwarded[1], sum, total)
	}

	acked := c.waitAcked(ctx, int(sum))
	arrivals := map[string]int{}
	duplicateClaims := 0
	for _, d := range acked {
		arrivals[d.uuid]++
		if d.result == dedupe.Duplicate {
			duplicateClaims++
		}
	}
	for id := range want {
		if arrivals[id] == 0 {
			t.Errorf("message %s lost", id)
		}
	}
	if len(arrivals) != total {
		t.Errorf("%d distinct messages arrived, want %d", len(arrivals), total)
	}
	dups := len(acked) - len(arrivals)
	t.Logf("two relays: forwarded %d + %d = %d; %d arrivals of %d messages, %d duplicates (%d acked as dedupe duplicates); published in %v, drained in %v, consumed in %v",
		forwarded[0], forwarded[1], sum, len(acked), len(arrivals), dups, duplicateClaims,
		published.Round(time.Millisecond), drained.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	if duplicateClaims != dups {
		t.Errorf("%d deliveries acked as duplicates by dedupe, want %d (every extra copy)", duplicateClaims, dups)
	}
	rows, distinct := c.effectRows()
	if rows != total || distinct != total {
		t.Errorf("%d effect rows for %d messages, want %d for %d", rows, distinct, total, total)
	}
	if n := e.countRows(e.biz); n != txs {
		t.Errorf("%d business rows, want %d", n, txs)
	}
}
