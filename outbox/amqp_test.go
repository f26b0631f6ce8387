package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// RabbitMQ's limits on this broker's defaults (rabbitmqctl environment):
// max_message_size 128 MiB for a message, frame_max 128 KiB for the frame
// that carries a message's properties and headers.
const (
	rabbitMaxMessage = 128 << 20
	rabbitFrameMax   = 128 << 10
)

// broker is one test's RabbitMQ: fanout exchanges named after the outbox's
// destination topics, each bound to a queue of the same name, and a
// watermill-amqp publisher that declares the exchange of each topic it
// publishes to (fanout, durable) and waits for the broker's confirm.
type broker struct {
	t   *testing.T
	url string
	ch  *amqp091.Channel
	pub *amqp.Publisher
}

func newBroker(t *testing.T) *broker {
	t.Helper()
	b := &broker{t: t, url: testenv.AMQPURL(t)}
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if b.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	cfg := amqp.NewDurablePubSubConfig(b.url, nil)
	cfg.Publish.ConfirmDelivery = true
	if b.pub, err = amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil)); err != nil {
		t.Fatal(err)
	}
	// Registered after the admin connection's cleanup: runs before it.
	t.Cleanup(func() {
		if err := b.pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	return b
}

// topic declares a fanout exchange and a queue bound to it, both named
// after a new topic, and deletes them when the test ends.
func (b *broker) topic(prefix string) string {
	b.t.Helper()
	name := testenv.Name(b.t, prefix)
	b.declare(name, "fanout")
	if _, err := b.ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { _, _ = b.ch.QueueDelete(name, false, false, false) })
	if err := b.ch.QueueBind(name, "", name, false, nil); err != nil {
		b.t.Fatal(err)
	}
	return name
}

// refused declares the exchange of a new topic as a direct exchange: the
// publisher's declaration of it as fanout fails (PRECONDITION_FAILED), and
// the broker closes the channel, at every publish.
func (b *broker) refused() string {
	b.t.Helper()
	name := testenv.Name(b.t, "refused")
	b.declare(name, "direct")
	return name
}

func (b *broker) declare(name, kind string) {
	b.t.Helper()
	if err := b.ch.ExchangeDeclare(name, kind, true, false, false, false, nil); err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { _ = b.ch.ExchangeDelete(name, false, false) })
}

// take moves every message now on queue q into got (UUID -> deliveries).
func (b *broker) take(q string, got map[string]int) {
	b.t.Helper()
	for {
		d, ok, err := b.ch.Get(q, true)
		if err != nil {
			b.t.Fatal(err)
		}
		if !ok {
			return
		}
		m, err := amqp.DefaultMarshaler{}.Unmarshal(d)
		if err != nil {
			b.t.Fatal(err)
		}
		got[m.UUID]++
	}
}

// publishTx writes msgs to topic through the outbox in one transaction.
func (e *env) publishTx(t testing.TB, topic string, msgs ...*message.Message) {
	t.Helper()
	if err := e.tryPublishTx(t, topic, msgs...); err != nil {
		t.Fatal(err)
	}
}

func (e *env) tryPublishTx(t testing.TB, topic string, msgs ...*message.Message) error {
	tx, err := e.ob.begin(t.Context())
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := tx.Pub.Publish(topic, msgs...); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	e.ob.Notify()
	return nil
}

// failedCounter reads settle.outbox.failed, 0 before the first failure.
func failedCounter(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "settle.outbox.failed" && len(d.DataPoints) > 0 {
				return d.DataPoints[0].Value
			}
		}
	}
	return 0
}

// brokerCases are the drivers of the tests with RabbitMQ.
var brokerCases = []drv{sqliteDrv, postgresDrv, pgxDrv, {name: "mysql", open: testenv.MySQL}}

// A row the broker refuses for good holds no row behind it: a row to an
// exchange of the wrong kind (the broker closes the channel at each
// publish) and a row larger than the broker's max_message_size (128 MiB;
// the broker closes the channel too) are retried with backoff while the
// rows of later transactions are forwarded, then set aside, visible in
// Status and Failed; settle.outbox.failed counts the failed attempts of
// those rows only. On every database and both PostgreSQL drivers, into
// RabbitMQ through watermill-amqp with publisher confirms.
//
// MariaDB's max_allowed_packet (16 MiB here) refuses a row that large when
// the application writes it: there the test checks that this write fails,
// and the refused exchange is the bad row; so it is on SQLite (see below).
func TestRelayForwardsAroundRowsTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	for _, c := range brokerCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, c)
			b := newBroker(t)
			good, bad := b.topic("good"), b.refused()

			const maxAttempts = 3
			refused := message.NewMessage("refused-"+watermill.NewUUID(), []byte(`{"to":"wrong exchange"}`))
			huge := message.NewMessage("huge-"+watermill.NewUUID(), bytes.Repeat([]byte{'x'}, rabbitMaxMessage+1024))
			setAside := []*message.Message{refused, huge}
			retry, maxRetry := 50*time.Millisecond, 300*time.Millisecond
			switch e.db.Dialect {
			case sqldb.SQLite:
				// SQLite rewrites the whole row at each claim, with the
				// database's write lock held: under the race detector
				// modernc's SQLite takes longer than a batch's AckDeadline
				// for a 128 MiB row. The refused exchange is the bad row.
				setAside = setAside[:1]
			case sqldb.MySQL:
				if err := e.tryPublishTx(t, good, huge); err == nil || !strings.Contains(err.Error(), "outbox: publish") {
					t.Fatalf("writing a 128 MiB row on MariaDB = %v; want the outbox publish to fail", err)
				}
				setAside = setAside[:1]
			}
			e.publishTx(t, bad, refused)
			if len(setAside) > 1 {
				e.publishTx(t, good, huge)
			}
			want := map[string]bool{}
			before := make([]*message.Message, 5)
			for i := range before {
				before[i] = message.NewMessage(fmt.Sprintf("before-%d-%s", i, watermill.NewUUID()), []byte(`{}`))
				want[before[i].UUID] = true
				e.publishTx(t, good, before[i])
			}

			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			startRelayOn(t, e.metered(t, mp), b.pub, outbox.RelayConfig{
				PollInterval: 20 * time.Millisecond, RetryInterval: retry, MaxRetryInterval: maxRetry,
				MaxAttempts: maxAttempts, AckDeadline: 30 * time.Second,
			})
			// Later transactions, while the bad rows are retried.
			for i := range 5 {
				m := message.NewMessage(fmt.Sprintf("after-%d-%s", i, watermill.NewUUID()), []byte(`{}`))
				want[m.UUID] = true
				e.publishTx(t, good, m)
				time.Sleep(50 * time.Millisecond)
			}

			got := map[string]int{}
			deadline := time.Now().Add(90 * time.Second)
			var st outbox.Status
			for {
				b.take(good, got)
				var err error
				if st, err = e.ob.Status(t.Context()); err != nil {
					t.Fatal(err)
				}
				if len(got) >= len(want) && st.SetAside == int64(len(setAside)) && st.Pending == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after 90s: %d of %d good messages on the queue, status %+v (%s)", len(got), len(want), st, st.Explain())
				}
				time.Sleep(50 * time.Millisecond)
			}
			b.take(good, got)
			for id := range want {
				if got[id] != 1 {
					t.Errorf("good message %s delivered %d times, want once", id, got[id])
				}
			}
			if got[huge.UUID] != 0 || len(got) != len(want) {
				t.Errorf("queue got %d distinct messages (huge one %d times), want the %d good ones", len(got), got[huge.UUID], len(want))
			}
			if st.State != outbox.StateSetAside || !strings.Contains(st.Explain(), fmt.Sprintf("%d row(s) set aside", len(setAside))) {
				t.Errorf("status %s (%s); want set_aside naming %d rows", st.State, st.Explain(), len(setAside))
			}
			if st.LiveRelays != 1 {
				t.Errorf("status counts %d live relays, want 1", st.LiveRelays)
			}

			var failed []outbox.FailedRow
			var err error
			failed, err = e.ob.Failed(t.Context(), outbox.Selection{SetAsideOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(failed) != len(setAside) {
				t.Fatalf("Failed = %+v; want %d rows", failed, len(setAside))
			}
			for i, m := range setAside {
				if failed[i].UUID != m.UUID {
					t.Fatalf("Failed[%d] is %s, want %s", i, failed[i].UUID, m.UUID)
				}
			}
			var attempts int64
			for _, f := range failed {
				attempts += int64(f.Attempts)
				if f.SetAsideAt.IsZero() || f.Attempts < maxAttempts || f.LastError == "" || f.SetAsideAt.Before(f.CreatedAt) {
					t.Errorf("set-aside row %+v: want set aside after at least %d attempts, with its error", f, maxAttempts)
				}
			}
			if !strings.Contains(failed[0].LastError, "PRECONDITION_FAILED") && !strings.Contains(failed[0].LastError, "406") {
				t.Errorf("refused row's last error %q does not say what the broker said", failed[0].LastError)
			}
			// The counter counts the failed attempts of the failing rows,
			// not the rows behind them.
			if n := failedCounter(t, reader); n != attempts {
				t.Errorf("settle.outbox.failed = %d; want %d, the attempts of the failing rows", n, attempts)
			}
		})
	}
}

// A row set aside stays until a person re-queues it: Requeue with a
// selection puts back only the rows it names, with a fresh count of
// attempts, and a relay forwards them once the cause is fixed.
func TestRequeueForwardsRowsSetAside(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, e *env) {
		broken := &topicDown{Publisher: e.pubsub, down: "orders.shipped"}
		placed, err := e.pubsub.Subscribe(t.Context(), "orders.shipped")
		if err != nil {
			t.Fatal(err)
		}
		e.publishTx(t, "orders.shipped", message.NewMessage("ship-1", []byte(`{}`)))
		e.publishTx(t, "orders.shipped", message.NewMessage("ship-2", []byte(`{}`)))
		startRelay(t, e, broken, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, RetryInterval: 10 * time.Millisecond, MaxRetryInterval: 20 * time.Millisecond, MaxAttempts: 2})
		// Rows to a healthy topic keep coming: the broker works.
		deadline := time.Now().Add(30 * time.Second)
		for {
			e.publishTx(t, "orders.placed", message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
			st, err := e.ob.Status(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if st.SetAside == 2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("rows not set aside: %+v", st)
			}
			time.Sleep(20 * time.Millisecond)
		}
		rows, err := e.ob.Failed(t.Context(), outbox.Selection{})
		if err != nil || len(rows) != 2 {
			t.Fatalf("Failed = %+v, %v", rows, err)
		}
		broken.fix()
		if n, err := e.ob.Requeue(t.Context(), outbox.Selection{Offsets: []int64{rows[1].Offset}}); err != nil || n != 1 {
			t.Fatalf("Requeue of one row = %d, %v", n, err)
		}
		select {
		case m := <-placed:
			m.Ack()
			if m.UUID != "ship-2" {
				t.Fatalf("got %s, want the re-queued ship-2", m.UUID)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the re-queued row was not forwarded")
		}
		st, err := e.ob.Status(t.Context())
		if err != nil || st.SetAside != 1 {
			t.Fatalf("after requeueing one of two: %+v, %v", st, err)
		}
		if n, err := e.ob.Requeue(t.Context(), outbox.Selection{Topic: "orders.elsewhere"}); err != nil || n != 0 {
			t.Fatalf("Requeue of another topic = %d, %v; want 0", n, err)
		}
		if n, err := e.ob.Requeue(t.Context(), outbox.Selection{}); err != nil || n != 1 {
			t.Fatalf("Requeue of all = %d, %v; want 1", n, err)
		}
		select {
		case m := <-placed:
			m.Ack()
			if m.UUID != "ship-1" {
				t.Fatalf("got %s, want ship-1", m.UUID)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the second re-queued row was not forwarded")
		}
	})
}

// topicDown refuses every publish to one topic until fixed.
type topicDown struct {
	message.Publisher
	mu    sync.Mutex
	down  string
	fixed bool
}

func (p *topicDown) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	refuse := topic == p.down && !p.fixed
	p.mu.Unlock()
	if refuse {
		return errors.New("Exception (404) Reason: \"NOT_FOUND - no exchange\"")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *topicDown) fix() {
	p.mu.Lock()
	p.fixed = true
	p.mu.Unlock()
}
