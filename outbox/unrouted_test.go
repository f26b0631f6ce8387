package outbox_test

import (
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
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/settle-go/settle/amqpsub"
	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/outbox"
)

// errorLog records the messages logged at error level.
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	msgs []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, fmt.Sprintf("%s: %v", msg, err))
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// matching counts the error messages containing s.
func (l *errorLog) matching(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, s) {
			n++
		}
	}
	return n
}

// watermillPublisher is a watermill-amqp Publisher on the test's broker with
// watermill-amqp's durable queue configuration, changed by set.
func watermillPublisher(t *testing.T, set func(*amqp.Config)) *amqp.Publisher {
	t.Helper()
	cfg := amqp.NewDurableQueueConfig(testenv.AMQPURL(t))
	set(&cfg)
	pub, err := amqp.NewPublisher(cfg, testenv.AMQPLogger(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	return pub
}

// amqpsubPublisher is settle's RabbitMQ publisher with watermill-amqp's
// durable queue configuration: the default exchange, a topic's messages
// routed to the queue of the same name.
func amqpsubPublisher(t *testing.T) *amqpsub.Publisher {
	t.Helper()
	pub, err := amqpsub.NewPublisher(amqpsub.PublisherConfig{AMQP: amqp.NewDurableQueueConfig(testenv.AMQPURL(t))}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Errorf("close publisher: %v", err)
		}
	})
	return pub
}

// A watermill-amqp Publisher that does not wait for the broker's
// confirmation is refused by every constructor of a relay, with an error
// naming the setting, and the outbox is left as it was; one that waits is
// accepted, with one error logged pointing to amqpsub.Publisher, because it
// cannot see a row routed to no queue.
func TestRelayRefusesAPublisherThatDoesNotConfirm(t *testing.T) {
	t.Parallel()
	e := setup(t, postgresDrv)
	e.publishTx(t, testenv.Name(t, "refused"), message.NewMessage(watermill.NewUUID(), []byte(`{}`)))

	unconfirmed := watermillPublisher(t, func(*amqp.Config) {})
	constructors := []struct {
		name string
		run  func(message.Publisher, outbox.RelayConfig) error
	}{
		{"NewRelay", func(out message.Publisher, cfg outbox.RelayConfig) error {
			return closed(e.ob.NewRelay(out, cfg))
		}},
		{"Forward", func(out message.Publisher, cfg outbox.RelayConfig) error {
			_, err := e.ob.Forward(t.Context(), out, cfg)
			return err
		}},
	}
	for _, c := range constructors {
		err := c.run(unconfirmed, outbox.RelayConfig{})
		if !errors.Is(err, outbox.ErrUnconfirmedPublisher) || !strings.Contains(err.Error(), "Publish.ConfirmDelivery") {
			t.Errorf("%s on watermill-amqp without ConfirmDelivery = %v; want ErrUnconfirmedPublisher naming Publish.ConfirmDelivery", c.name, err)
		}
	}
	if st, err := e.ob.Status(t.Context()); err != nil || st.Pending != 1 {
		t.Fatalf("after the refusals: status %+v, %v; want the row still pending", st, err)
	}

	accepted := []struct {
		name string
		pub  message.Publisher
		logs int // errors naming amqpsub.NewPublisher, per relay built
	}{
		{"ConfirmDelivery", watermillPublisher(t, func(c *amqp.Config) { c.Publish.ConfirmDelivery = true }), 1},
		{"Transactional", watermillPublisher(t, func(c *amqp.Config) { c.Publish.Transactional = true }), 1},
		{"amqpsub.Publisher", amqpsubPublisher(t), 0},
		{"gochannel", e.pubsub, 0},
	}
	for _, a := range accepted {
		for _, c := range constructors[:2] {
			log := &errorLog{}
			if err := c.run(a.pub, outbox.RelayConfig{Logger: log}); err != nil {
				t.Errorf("%s on %s: %v", c.name, a.name, err)
			}
			if n := log.matching("amqpsub.NewPublisher"); n != a.logs {
				t.Errorf("%s on %s logged %d errors naming amqpsub.NewPublisher, want %d (%q)", c.name, a.name, n, a.logs, log.msgs)
			}
		}
	}
}

// closed closes the relay a constructor returned, if it returned one.
func closed(r *outbox.Relay, err error) error {
	if err != nil {
		return err
	}
	return r.Close()
}

// unroutedCase is one run of the relay into RabbitMQ: rows to a queue that
// exists, and one row to a topic whose queue nobody declared.
type unroutedCase struct {
	t        *testing.T
	e        *env
	b        *broker
	relay    *outbox.Relay
	good     string
	unrouted string // no queue until declare
	want     map[string]bool
	lost     *message.Message
	got      map[string]int
	metrics  *sdkmetric.ManualReader
}

func startUnrouted(t *testing.T, c drv, out func(*testing.T) message.Publisher, log watermill.LoggerAdapter) *unroutedCase {
	t.Helper()
	u := &unroutedCase{t: t, e: setup(t, c), b: newBroker(t), want: map[string]bool{}, got: map[string]int{}, metrics: sdkmetric.NewManualReader()}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(u.metrics))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	u.good = testenv.Name(t, "good")
	u.unrouted = testenv.Name(t, "unrouted")
	for _, q := range []string{u.good, u.unrouted} {
		t.Cleanup(func() { _, _ = u.b.ch.QueueDelete(q, false, false, false) })
	}
	if _, err := u.b.ch.QueueDeclare(u.good, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	u.lost = message.NewMessage("unrouted-"+watermill.NewUUID(), []byte(`{"to":"a queue nobody declared"}`))
	u.e.publishTx(t, u.unrouted, u.lost)
	for i := range 5 {
		m := message.NewMessage(fmt.Sprintf("before-%d-%s", i, watermill.NewUUID()), []byte(`{}`))
		u.want[m.UUID] = true
		u.e.publishTx(t, u.good, m)
	}
	u.relay = startRelayOn(t, u.e.metered(t, mp), out(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, RetryInterval: 50 * time.Millisecond, MaxRetryInterval: 300 * time.Millisecond,
		MaxAttempts: 3, AckDeadline: 30 * time.Second, Logger: log,
	})
	for i := range 5 {
		m := message.NewMessage(fmt.Sprintf("after-%d-%s", i, watermill.NewUUID()), []byte(`{}`))
		u.want[m.UUID] = true
		u.e.publishTx(t, u.good, m)
		time.Sleep(50 * time.Millisecond)
	}
	return u
}

// waitFor polls the good queue and the outbox's status until done says so.
func (u *unroutedCase) waitFor(what string, done func(outbox.Status) bool) outbox.Status {
	u.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		u.b.take(u.good, u.got)
		st, err := u.e.ob.Status(u.t.Context())
		if err != nil {
			u.t.Fatal(err)
		}
		if done(st) {
			return st
		}
		if time.Now().After(deadline) {
			u.t.Fatalf("after 90s, not %s: %d of %d good messages on their queue, status %+v (%s)", what, len(u.got), len(u.want), st, st.Explain())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkGood fails unless every good row was delivered once, and nothing
// else reached the good queue.
func (u *unroutedCase) checkGood() {
	u.t.Helper()
	for id := range u.want {
		if u.got[id] != 1 {
			u.t.Errorf("good message %s delivered %d times, want once", id, u.got[id])
		}
	}
	if len(u.got) != len(u.want) {
		u.t.Errorf("good queue got %d distinct messages, want %d", len(u.got), len(u.want))
	}
}

func (u *unroutedCase) failed() []outbox.FailedRow {
	u.t.Helper()
	var rows []outbox.FailedRow
	var err error
	rows, err = u.e.ob.Failed(u.t.Context(), outbox.Selection{})
	if err != nil {
		u.t.Fatal(err)
	}
	return rows
}

// A row to a queue nobody declared, relayed through amqpsub.Publisher, is a
// failed publish like any refused row: RabbitMQ returns it (basic.return),
// the publish fails with amqpsub.ErrUnroutable, the row is retried with
// backoff while the rows to the declared queue are delivered, once each, and
// it is set aside, visible in Status and Failed. Once the queue exists and
// the row is re-queued, it is delivered once. On every database and both
// PostgreSQL drivers.
func TestRelaySetsAsideRowsRoutedToNoQueue(t *testing.T) {
	t.Parallel()
	for _, c := range brokerCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			u := startUnrouted(t, c, func(t *testing.T) message.Publisher { return amqpsubPublisher(t) }, nil)
			st := u.waitFor("set aside", func(st outbox.Status) bool {
				return len(u.got) >= len(u.want) && st.SetAside == 1 && st.Pending == 0
			})
			u.checkGood()
			if st.State != outbox.StateSetAside {
				t.Errorf("status %s (%s); want set_aside", st.State, st.Explain())
			}
			rows := u.failed()
			if len(rows) != 1 || rows[0].UUID != u.lost.UUID || rows[0].SetAsideAt.IsZero() || rows[0].Attempts < 3 || rows[0].Topic != u.unrouted {
				t.Fatalf("Failed = %+v; want the unrouted row %s to %s, set aside after 3 attempts", rows, u.lost.UUID, u.unrouted)
			}
			if n := failedCounter(t, u.metrics); n != int64(rows[0].Attempts) {
				t.Errorf("settle.outbox.failed = %d; want %d, the unrouted row's attempts", n, rows[0].Attempts)
			}
			if !strings.Contains(rows[0].LastError, amqpsub.ErrUnroutable.Error()) || !strings.Contains(rows[0].LastError, "NO_ROUTE") {
				t.Errorf("last error %q does not say the broker routed the row to no queue", rows[0].LastError)
			}

			// The cause fixed: the queue declared, the row re-queued.
			if _, err := u.b.ch.QueueDeclare(u.unrouted, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			var n int64
			var err error
			n, err = u.e.ob.Requeue(t.Context(), outbox.Selection{Offsets: []int64{rows[0].Offset}})
			if err != nil || n != 1 {
				t.Fatalf("Requeue = %d, %v; want 1", n, err)
			}
			u.e.ob.Notify()
			fixed := map[string]int{}
			u.waitFor("forwarded after Requeue", func(st outbox.Status) bool {
				u.b.take(u.unrouted, fixed)
				return fixed[u.lost.UUID] > 0 && st.SetAside == 0 && st.Pending == 0
			})
			if err := u.relay.Drain(t.Context()); err != nil {
				t.Fatal(err)
			}
			u.b.take(u.unrouted, fixed)
			u.b.take(u.good, u.got)
			if fixed[u.lost.UUID] != 1 || len(fixed) != 1 {
				t.Errorf("after Requeue the queue got %v; want %s once", fixed, u.lost.UUID)
			}
			u.checkGood()
			if rows := u.failed(); len(rows) != 0 {
				t.Errorf("Failed after the re-queued row was forwarded = %+v; want none", rows)
			}
		})
	}
}

// The limitation that amqpsub.Publisher removes: watermill-amqp's Publisher,
// confirms on, does not listen for basic.return, and RabbitMQ confirms a
// message it routed nowhere. A row to a queue nobody declared is marked
// forwarded and is gone: nothing pending, nothing set aside, nothing on the
// queue once it exists. The relay says so at construction, with an error
// pointing to amqpsub.NewPublisher.
func TestWatermillAMQPRelayMarksRowsRoutedToNoQueueForwarded(t *testing.T) {
	t.Parallel()
	log := &errorLog{}
	u := startUnrouted(t, postgresDrv, func(t *testing.T) message.Publisher {
		return watermillPublisher(t, func(c *amqp.Config) { c.Publish.ConfirmDelivery = true })
	}, log)
	if n := log.matching("amqpsub.NewPublisher"); n != 1 {
		t.Errorf("building the relay logged %d errors naming amqpsub.NewPublisher, want 1 (%q)", n, log.msgs)
	}
	st := u.waitFor("drained", func(st outbox.Status) bool { return len(u.got) >= len(u.want) && st.Pending == 0 })
	if err := u.relay.Drain(t.Context()); err != nil {
		t.Fatal(err)
	}
	u.b.take(u.good, u.got)
	u.checkGood()
	if st.SetAside != 0 || len(u.failed()) != 0 {
		t.Errorf("status %+v, Failed %+v; want the unrouted row taken as forwarded, nothing set aside", st, u.failed())
	}
	var forwarded bool
	if err := u.e.db.QueryRowContext(t.Context(),
		"SELECT forwarded_at IS NOT NULL FROM "+quoteTable(u.e, u.e.ob.Table())+" WHERE uuid = "+u.e.ph(1), u.lost.UUID).Scan(&forwarded); err != nil {
		t.Fatal(err)
	}
	if !forwarded {
		t.Errorf("the unrouted row is not marked forwarded")
	}
	if _, err := u.b.ch.QueueDeclare(u.unrouted, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	lost := map[string]int{}
	u.b.take(u.unrouted, lost)
	if len(lost) != 0 {
		t.Errorf("the queue declared afterwards holds %v; RabbitMQ dropped the row, it should hold nothing", lost)
	}
}
