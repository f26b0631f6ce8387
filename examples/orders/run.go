package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/trace"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/sqldb"
)

type config struct {
	Orders int
	DB     string
	// Broker is -broker: gochannel, amqp, nats, redis or sql; "" is amqp
	// when AMQP is set, else gochannel.
	Broker string
	// The brokers' URLs; sql runs on DB.
	AMQP, NATS, Redis string
	Quiet             bool
	// Keep leaves the run's tables and queues, and earlier runs' leftovers,
	// in place.
	Keep bool
	// Out receives the progress and the table; Err the warnings. Nil
	// discards.
	Out, Err io.Writer
	// Timeout bounds the time from placing the first order to the last
	// settlement. Defaults to 60s.
	Timeout time.Duration
}

// errInterrupted is returned when the run was cancelled (Ctrl-C).
var errInterrupted = errors.New("interrupted")

// leftoverAge is how old an earlier run's tables and queues must be before
// a run removes them: a younger run may still be going on.
const leftoverAge = 10 * time.Minute

// The example's business events.
type orderPlaced struct {
	OrderID string `json:"order_id"`
	Cents   int    `json:"cents"`
	Email   string `json:"email"`
}

type orderCharged struct {
	OrderID string `json:"order_id"`
	Email   string `json:"email"`
}

// Which orders misbehave, so that every outcome shows up.
func redelivered(n int) bool  { return n%5 == 0 } // the broker delivers it twice
func flakyMail(n int) bool    { return n%3 == 0 } // the mail server fails once
func bouncingMail(n int) bool { return n == 7 }   // the mail server always fails

func run(parent context.Context, cfg config) (err error) {
	if cfg.Orders <= 0 {
		return fmt.Errorf("-orders must be > 0, got %d", cfg.Orders)
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Err == nil {
		cfg.Err = io.Discard
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 60 * time.Second
	}
	spec, err := brokerSpec{Kind: cfg.Broker, AMQP: cfg.AMQP, NATS: cfg.NATS, Redis: cfg.Redis}.resolve()
	if err != nil {
		return err
	}
	ctx := parent // the setup's; the pipeline's own has the timeout
	defer func() {
		if err != nil && parent.Err() != nil && !errors.Is(err, errInterrupted) {
			err = fmt.Errorf("%w: %v", errInterrupted, err)
		}
	}()
	progress := cfg.Out
	if cfg.Quiet {
		progress = io.Discard
	}
	say := func(format string, args ...any) { fmt.Fprintf(progress, format+"\n", args...) }
	// keep is set when the run's tables and queues are to stay: -keep, or a
	// timeout, whose evidence is worth a look.
	keep := cfg.Keep
	sqliteFile := "" // the embedded default's

	if cfg.DB == "" {
		dir, err := os.MkdirTemp("", "settle-orders")
		if err != nil {
			return err
		}
		sqliteFile = filepath.Join(dir, "orders.db")
		cfg.DB = "sqlite://" + sqliteFile
		defer func() {
			if !keep {
				_ = os.RemoveAll(dir)
			}
		}()
	}
	// watermill-sql's subscriber holds a connection, in a transaction, for
	// each subscription while the messages it read are handled: the pool
	// needs those two beside the handlers', the relay's and the store's.
	var minConns int32
	if spec.Kind == brokerSQL {
		minConns = 12
	}
	db, dialect, pool, err := openDB(ctx, cfg.DB, minConns)
	if err != nil {
		return err
	}
	defer db.Close()
	if pool != nil {
		defer pool.Close()
	}
	driver := "" // how settle reaches the database, when it is not database/sql
	if pool != nil {
		driver = " via pgx"
	}
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("database %s: %w", dialect, err)
	}

	tel, err := newTelemetry(ctx, progress, cfg.Err)
	if err != nil {
		return err
	}
	defer tel.shutdown()

	if !cfg.Keep {
		l, err := removeLeftovers(ctx, db, dialect, spec, time.Now(), leftoverAge)
		if err != nil {
			return fmt.Errorf("removing earlier runs' leftovers: %w", err)
		}
		if len(l.runs) > 0 {
			say("removed what %d earlier runs left behind (%s): %d tables, %d %s", len(l.runs), strings.Join(l.runs, ", "), len(l.tables), len(l.queues), brokerObjects(spec.Kind))
		}
	}

	runID := newRunID(time.Now())
	s, err := newSchema(ctx, db, dialect, runID)
	if err != nil {
		return err
	}
	defer func() {
		if !keep {
			s.drop()
		}
	}()

	br, err := newBroker(ctx, spec, runID, db, dialect, pool)
	if err != nil {
		return err
	}
	defer func() {
		if !keep && br.remove != nil {
			br.remove()
		}
	}()
	defer br.close()
	defer func() {
		if !keep {
			return
		}
		kept := []string{"tables " + strings.Join(tableNames(runID), ", ")}
		if sqliteFile != "" {
			kept = []string{"the SQLite file " + sqliteFile + " with " + kept[0]}
		}
		if br.what != "" {
			kept = append(kept, br.what)
		}
		fmt.Fprintf(cfg.Out, "kept for a look (run %s): %s.\n", runID, strings.Join(kept, "; "))
		if sqliteFile == "" {
			fmt.Fprintf(cfg.Out, "The next run removes them once they are %s old, unless it has -keep.\n", leftoverAge)
		}
	}()

	// On PostgreSQL settle runs on the pgx pool; elsewhere on database/sql.
	// The dead-lettered and poisoned messages are parked in a table of the
	// same database, where settle parked and the console find them.
	var (
		store       dedupe.Store
		parkedStore interface {
			settle.ParkStore
			Count(context.Context, parked.Filter) (int64, error)
		}
	)
	if pool != nil {
		store, err = dedupe.NewSQLStore(sqldb.Pgx(pool), dedupe.SQLConfig{Table: s.claims})
		if err == nil {
			parkedStore, err = parked.New(sqldb.Pgx(pool), parked.Config{Table: s.parked})
		}
	} else {
		store, err = dedupe.NewSQLStore(sqldb.Std(db, dialect), dedupe.SQLConfig{Table: s.claims})
		if err == nil {
			parkedStore, err = parked.New(sqldb.Std(db, dialect), parked.Config{Table: s.parked})
		}
	}
	if err != nil {
		return err
	}
	obCfg := outbox.Config{Topic: s.outboxTopic, Tracing: []settle.Option{settle.WithPropagators(propagation.TraceContext{}), settle.WithTracerProvider(tel.tp), settle.WithMeterProvider(tel.mp)}}
	// One outbox, on the driver the example runs on; ob is what does not
	// depend on the driver's transaction type.
	var (
		obPgx *outbox.Outbox[pgx.Tx]
		obSQL *outbox.Outbox[*sql.Tx]
		ob    interface {
			InitSchema(context.Context) error
			Table() string
			NewRelay(message.Publisher, outbox.RelayConfig) (*outbox.Relay, error)
		}
	)
	if pool != nil {
		obPgx, err = outbox.New(sqldb.Pgx(pool), obCfg)
		ob = obPgx
	} else {
		obSQL, err = outbox.New(sqldb.Std(db, sqldb.Dialect(dialect)), obCfg)
		ob = obSQL
	}
	if err != nil {
		return err
	}
	if err := ob.InitSchema(ctx); err != nil {
		return err
	}
	defer func() {
		if !keep {
			s.dropOutbox(ob.Table())
		}
	}()

	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	p, err := pipeline.New(router, pipeline.Config{
		Publisher:    br.pub,
		Store:        store,
		ParkStore:    parkedStore, // instead of dead-letter and poison topics
		ClaimTimeout: 5 * time.Second,
		BusyDelay:    100 * time.Millisecond,
		Retry: middleware.RetryConfig{
			MaxAttempts:      3,
			InProcessRetries: 1,
			InitialInterval:  20 * time.Millisecond,
			RedeliveryDelay:  100 * time.Millisecond,
		},
		Tracing: []settle.Option{
			settle.WithTracerProvider(tel.tp), settle.WithMeterProvider(tel.mp),
			settle.WithPropagators(propagation.TraceContext{}), settle.WithMessagingSystem(br.system),
		},
	})
	if err != nil {
		return err
	}

	topics := br.topics
	var emailed atomic.Int64
	// charge: once per order, in one transaction with the charge row and the
	// "charged" event in the outbox.
	if pool != nil {
		_, err = pipeline.HandleTx(p, "charge", topics.placed, br.sub, pipeline.TxConfig[pgx.Tx]{DB: sqldb.Pgx(pool), Outbox: obPgx}, chargePgx(s, topics.charged))
	} else {
		_, err = pipeline.HandleTx(p, "charge", topics.placed, br.sub, pipeline.TxConfig[*sql.Tx]{DB: sqldb.Std(db, dialect), Outbox: obSQL},
			pipeline.TypedTx(nil, func(ctx context.Context, tx *sql.Tx, m pipeline.Message[orderPlaced], out message.Publisher) error {
				if _, err := tx.ExecContext(ctx, "INSERT INTO "+s.charges+" (order_id, cents) VALUES ("+s.ph(1)+", "+s.ph(2)+")", m.Body.OrderID, m.Body.Cents); err != nil {
					return err
				}
				ev, err := chargedEvent(ctx, m.Body)
				if err != nil {
					return err
				}
				return out.Publish(topics.charged, ev)
			}))
	}
	if err != nil {
		return err
	}
	// email: a flaky mail server; one address always bounces.
	if _, err := p.Handle("email", topics.charged, br.sub, pipeline.Typed(nil, func(ctx context.Context, m pipeline.Message[orderCharged]) error {
		var n int
		_, _ = fmt.Sscanf(m.Body.OrderID, "A-%d", &n)
		switch {
		case bouncingMail(n):
			return fmt.Errorf("smtp: 450 mailbox %s unavailable", m.Body.Email)
		case flakyMail(n) && settle.SettlementFromContext(ctx).Attempt() == 1:
			return errors.New("smtp: connection reset by peer")
		}
		if _, err := db.ExecContext(ctx, "INSERT INTO "+s.emails+" (order_id) VALUES ("+s.ph(1)+")", m.Body.OrderID); err != nil {
			return err
		}
		emailed.Add(1)
		return nil
	})); err != nil {
		return err
	}

	// The default PollInterval (1 s) is only the fallback: the charge
	// handler's commits (pipeline.HandleTx) and placeOrder wake the relay
	// through Outbox.Notify, and on PostgreSQL the INSERT's NOTIFY does.
	relay, err := ob.NewRelay(br.pub, outbox.RelayConfig{})
	if err != nil {
		return err
	}
	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	routerDone := make(chan error, 1)
	relayDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	go func() { relayDone <- relay.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return fmt.Errorf("router: %w", err)
	}
	<-relay.Running()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		return errors.Join(router.Close(), <-routerDone, relay.Close(), <-relayDone)
	}
	defer func() { _ = stop() }()

	// early stops the run on Ctrl-C or at the timeout, and shows what had
	// settled by then. A timeout keeps the tables and queues.
	early := func(where string) error {
		stopErr := stop()
		fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer fcancel()
		var what error
		if parent.Err() != nil {
			what = fmt.Errorf("%w: stopped before the pipeline settled; the table shows the deliveries settled so far", errInterrupted)
			fmt.Fprintf(cfg.Out, "\ninterrupted: %s\n", where)
		} else {
			keep = true // the evidence of what did not settle
			what = fmt.Errorf("the pipeline did not settle within %s (-timeout); the table shows the deliveries settled so far", cfg.Timeout)
			fmt.Fprintf(cfg.Out, "\ntimed out after %s: %s\n", cfg.Timeout, where)
		}
		counts, err := tel.outcomes(fctx)
		if err != nil {
			return errors.Join(what, stopErr, err)
		}
		charges, emails, err := s.counts(fctx)
		rows, perr := parkedStore.Count(fctx, parked.Filter{})
		fwd, failed := relay.Counts()
		report(cfg.Out, counts, charges, emails, rows, fwd, failed)
		return errors.Join(what, stopErr, err, perr)
	}

	// Place the orders: each in a transaction of its own, with its row and
	// its "placed" event in the outbox.
	say("orders: %s + %s%s, %d orders (run %s)", br.system, dialect, driver, cfg.Orders, runID)

	// From here on the pipeline has cfg.Timeout to settle.
	ctx, cancel := context.WithTimeout(parent, cfg.Timeout)
	defer cancel()
	tracer := tel.tp.Tracer("settle-orders")
	placed := map[string]*message.Message{}
	for i := 1; i <= cfg.Orders; i++ {
		o := orderPlaced{OrderID: fmt.Sprintf("A-%03d", i), Cents: 1000 + i, Email: fmt.Sprintf("customer%d@example.com", i)}
		if ctx.Err() != nil {
			return early(fmt.Sprintf("placed %d of %d orders", i-1, cfg.Orders))
		}
		var msg *message.Message
		if pool != nil {
			msg, err = placeOrderPgx(ctx, tracer, pool, obPgx, s, topics.placed, o)
		} else {
			msg, err = placeOrder(ctx, tracer, db, obSQL, s, topics.placed, o)
		}
		if err != nil {
			if ctx.Err() != nil {
				return early(fmt.Sprintf("placed %d of %d orders", i-1, cfg.Orders))
			}
			return err
		}
		placed[o.OrderID] = msg
	}
	say("placed %d orders through the outbox", cfg.Orders)

	// The broker delivers some orders twice, and a producer with a bug sends
	// a message nobody can decode.
	dups := 0
	for i := 1; i <= cfg.Orders; i++ {
		if redelivered(i) {
			m := placed[fmt.Sprintf("A-%03d", i)]
			again := message.NewMessage(m.UUID, m.Payload)
			for k, v := range m.Metadata {
				again.Metadata.Set(k, v)
			}
			if err := br.pub.Publish(topics.placed, again); err != nil {
				return err
			}
			dups++
		}
	}
	if err := br.pub.Publish(topics.placed, message.NewMessage(watermill.NewUUID(), []byte(`{"order_id": 17, "cents": "a lot"`))); err != nil {
		return err
	}
	say("the broker redelivered %d orders; a producer sent 1 malformed message", dups)

	want := expectation{orders: cfg.Orders, dups: dups}
	for i := 1; i <= cfg.Orders; i++ {
		if bouncingMail(i) {
			want.bounced++
		}
	}
	var counts outcomeCounts
	last := ""
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		counts, err = tel.outcomes(ctx)
		if err != nil {
			return err
		}
		line := fmt.Sprintf("progress: charged %d/%d, e-mailed %d, dead-lettered %d, poisoned %d, duplicates absorbed %d",
			counts.get("charge", settle.Done), cfg.Orders, emailed.Load(), counts.get("email", settle.DeadLettered),
			counts.get("charge", settle.Poisoned), counts.get("charge", settle.Duplicate))
		if line != last {
			say("%s", line)
			last = line
		}
		if want.met(counts) {
			break
		}
		select {
		case <-ctx.Done():
			return early(line)
		case <-tick.C:
		}
	}
	if err := relay.Drain(ctx); err != nil {
		if ctx.Err() != nil {
			return early("every delivery settled; the outbox was still draining")
		}
		return err
	}
	if err := stop(); err != nil {
		return err
	}
	if counts, err = tel.outcomes(ctx); err != nil {
		return err
	}

	charges, emails, err := s.counts(ctx)
	if err != nil {
		return err
	}
	rows, err := parkedStore.Count(ctx, parked.Filter{})
	if err != nil {
		return err
	}
	fwd, failed := relay.Counts()
	report(cfg.Out, counts, charges, emails, rows, fwd, failed)
	if rows != int64(1+want.bounced) {
		return fmt.Errorf("%d parked rows, want %d (the malformed message and the bounced e-mails)", rows, 1+want.bounced)
	}
	if charges != cfg.Orders {
		return fmt.Errorf("%d charges for %d orders", charges, cfg.Orders)
	}
	if emails != cfg.Orders-want.bounced {
		return fmt.Errorf("%d e-mails sent, want %d", emails, cfg.Orders-want.bounced)
	}
	fmt.Fprintln(cfg.Out, "every order charged exactly once")
	return nil
}

// counts returns how many charges and e-mails the run's tables hold.
func (s *schema) counts(ctx context.Context) (charges, emails int, err error) {
	if err := s.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.charges).Scan(&charges); err != nil {
		return 0, 0, err
	}
	if err := s.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.emails).Scan(&emails); err != nil {
		return 0, 0, err
	}
	return charges, emails, nil
}

// publishPlaced writes o's "placed" event to the outbox in tx, on either
// driver: it is sent when tx commits.
func publishPlaced[TTx any](ctx context.Context, ob *outbox.Outbox[TTx], tx TTx, topic string, o orderPlaced) (*message.Message, error) {
	msg, err := pipeline.NewMessage("placed-"+o.OrderID, nil, o)
	if err != nil {
		return nil, err
	}
	msg.SetContext(ctx)
	pub, err := ob.TxPublisher(tx)
	if err != nil {
		return nil, err
	}
	if err := pub.Publish(topic, msg); err != nil {
		return nil, err
	}
	return msg, nil
}

func placeOrder(ctx context.Context, tracer trace.Tracer, db *sql.DB, ob *outbox.Outbox[*sql.Tx], s *schema, topic string, o orderPlaced) (*message.Message, error) {
	ctx, span := tracer.Start(ctx, "place order", trace.WithAttributes(attribute.String("order.id", o.OrderID)))
	defer span.End()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+s.orders+" (id, cents) VALUES ("+s.ph(1)+", "+s.ph(2)+")", o.OrderID, o.Cents); err != nil {
		return nil, err
	}
	msg, err := publishPlaced(ctx, ob, tx, topic, o)
	if err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	ob.Notify() // the relay of this process forwards at once
	return msg, nil
}

type expectation struct{ orders, dups, bounced int }

func (w expectation) met(c outcomeCounts) bool {
	return c.get("charge", settle.Done) == w.orders &&
		c.get("charge", settle.Duplicate) >= w.dups &&
		c.get("charge", settle.Poisoned) == 1 &&
		c.get("email", settle.Done) == w.orders-w.bounced &&
		c.get("email", settle.DeadLettered) == w.bounced
}

// outcomeCounts is settle.settlements by handler and outcome.
type outcomeCounts map[string]map[settle.Outcome]int64

func (c outcomeCounts) get(handler string, o settle.Outcome) int {
	return int(c[handler][o])
}

func report(out io.Writer, c outcomeCounts, charges, emails int, parkedRows, forwarded, failed int64) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	handlers := make([]string, 0, len(c))
	for h := range c {
		handlers = append(handlers, h)
	}
	sort.Strings(handlers)
	fmt.Fprintf(tw, "\ndeliveries by outcome\t%s\ttotal\t\n", strings.Join(handlers, "\t"))
	for _, o := range []settle.Outcome{settle.Done, settle.Duplicate, settle.Deferred, settle.Retry, settle.DeadLettered, settle.Poisoned} {
		fmt.Fprintf(tw, "%s\t", o)
		total := 0
		for _, h := range handlers {
			n := c.get(h, o)
			total += n
			fmt.Fprintf(tw, "%d\t", n)
		}
		fmt.Fprintf(tw, "%d\t\n", total)
	}
	fmt.Fprintf(tw, "\t\t\t\t\n")
	fmt.Fprintf(tw, "charges applied\t%d\t\t\t\n", charges)
	fmt.Fprintf(tw, "e-mails sent\t%d\t\t\t\n", emails)
	fmt.Fprintf(tw, "duplicates absorbed\t%d\t\t\t\n", c.get("charge", settle.Duplicate)+c.get("email", settle.Duplicate))
	fmt.Fprintf(tw, "parked rows\t%d\t\t\t\n", parkedRows)
	fmt.Fprintf(tw, "outbox messages forwarded\t%d\t\t\t\n", forwarded)
	if failed > 0 {
		fmt.Fprintf(tw, "outbox forwards failed\t%d\t\t\t\n", failed)
	}
	_ = tw.Flush()
}

// readOutcomes reads settle.settlements from the reader.
func readOutcomes(ctx context.Context, r *sdkmetric.ManualReader) (outcomeCounts, error) {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(ctx, &rm); err != nil {
		return nil, err
	}
	c := outcomeCounts{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok || m.Name != "settle.settlements" {
				continue
			}
			for _, dp := range sum.DataPoints {
				h, _ := dp.Attributes.Value("settle.handler")
				o, _ := dp.Attributes.Value("settle.outcome")
				if c[h.AsString()] == nil {
					c[h.AsString()] = map[settle.Outcome]int64{}
				}
				c[h.AsString()][settle.Outcome(o.AsString())] += dp.Value
			}
		}
	}
	return c, nil
}
