// Command orders is settle's main example: an order pipeline on the embedded
// default (Watermill's GoChannel and a SQLite file, no server needed).
//
// Every order is published twice, as a broker does after a lost ack, and
// every third charge fails on its first attempt. The charge handler sits
// behind settle's dedupe middleware, so each order is charged exactly once:
//
//	go run ./examples/orders
//	go run ./examples/orders -orders 100 -db sqlite://orders.db
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/internal/sqlurl"
)

func main() {
	var cfg config
	flag.IntVar(&cfg.Orders, "orders", 20, "number of orders to place")
	flag.StringVar(&cfg.DB, "db", "", "database URL (sqlite://, postgres://, mysql://); default: a new SQLite file in a temporary directory")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

type config struct {
	Orders int
	DB     string
}

type stats struct {
	deliveries, runs, failures, duplicates, deferred atomic.Int64
}

func run(ctx context.Context, cfg config, out io.Writer) error {
	if cfg.Orders <= 0 {
		return fmt.Errorf("-orders must be > 0, got %d", cfg.Orders)
	}
	if cfg.DB == "" {
		dir, err := os.MkdirTemp("", "settle-orders")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		cfg.DB = "sqlite://" + filepath.Join(dir, "orders.db")
	}
	db, dialect, err := sqlurl.Open(cfg.DB)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("database: %w", err)
	}

	// Schema: settle's claims table and the example's own charges table. A
	// real service runs these in its migrations.
	suffix := fmt.Sprintf("_%d", time.Now().UnixNano()) // a fresh pair of tables per run
	claims, charges := "orders_dedupe"+suffix, "orders_charges"+suffix
	ddl, err := dedupe.Schema(dialect, claims)
	if err != nil {
		return err
	}
	ddl = append(ddl, "CREATE TABLE "+charges+" (order_id VARCHAR(64) PRIMARY KEY, cents INTEGER NOT NULL)")
	for _, stmt := range ddl {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}
	defer func() {
		for _, t := range []string{claims, charges} {
			_, _ = db.ExecContext(context.WithoutCancel(ctx), "DROP TABLE "+t)
		}
	}()
	store, err := dedupe.NewSQLStore(db, dedupe.SQLConfig{Dialect: dialect, Table: claims})
	if err != nil {
		return err
	}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store, ClaimTimeout: 5 * time.Second})
	if err != nil {
		return err
	}

	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}

	var st stats
	var mu sync.Mutex
	failedOnce := map[string]bool{}
	settled := make(chan struct{}, 2*cfg.Orders)

	// count observes each delivery after dedupe has decided about it.
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			st.deliveries.Add(1)
			out, err := h(msg)
			c, _ := dedupe.ClaimFromContext(msg.Context())
			switch {
			case errors.Is(err, dedupe.ErrBusy):
				st.deferred.Add(1)
			case err == nil && c.Result == dedupe.Duplicate:
				st.duplicates.Add(1)
			}
			if err == nil {
				settled <- struct{}{}
			}
			return out, err
		}
	}

	charge := func(msg *message.Message) error {
		st.runs.Add(1)
		id := string(msg.Payload)
		mu.Lock()
		var n int
		_, _ = fmt.Sscanf(id, "order-%d", &n)
		fail := !failedOnce[id] && n%3 == 0
		failedOnce[id] = true
		mu.Unlock()
		if fail {
			st.failures.Add(1)
			return fmt.Errorf("payment provider timed out for %s", id)
		}
		_, err := db.ExecContext(msg.Context(), "INSERT INTO "+charges+" (order_id, cents) VALUES ("+placeholders(dialect)+")", id, 1999)
		return err
	}

	h := router.AddConsumerHandler("charge", "orders", pubsub, charge)
	h.AddMiddleware(count, dd)

	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()

	fmt.Fprintf(out, "placing %d orders, each delivered twice, every third charge failing once\n", cfg.Orders)
	for i := 1; i <= cfg.Orders; i++ {
		id := fmt.Sprintf("order-%03d", i)
		uuid := watermill.NewUUID()
		for range 2 { // the same message, twice: at-least-once delivery
			if err := pubsub.Publish("orders", message.NewMessage(uuid, []byte(id))); err != nil {
				return err
			}
		}
	}

	wait := time.NewTimer(30 * time.Second)
	defer wait.Stop()
	for n := 0; n < 2*cfg.Orders; n++ {
		select {
		case <-settled:
		case <-wait.C:
			return errors.New("timed out waiting for the pipeline to settle")
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerDone; err != nil {
		return err
	}
	if err := pubsub.Close(); err != nil {
		return err
	}

	var applied int
	if err := db.QueryRowContext(context.WithoutCancel(ctx), "SELECT count(*) FROM "+charges).Scan(&applied); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\t\t")
	fmt.Fprintf(tw, "orders placed\t%d\t\n", cfg.Orders)
	fmt.Fprintf(tw, "deliveries\t%d\t\n", st.deliveries.Load())
	fmt.Fprintf(tw, "handler runs\t%d\t\n", st.runs.Load())
	fmt.Fprintf(tw, "failed runs, redelivered\t%d\t\n", st.failures.Load())
	fmt.Fprintf(tw, "deferred (key busy)\t%d\t\n", st.deferred.Load())
	fmt.Fprintf(tw, "duplicates absorbed\t%d\t\n", st.duplicates.Load())
	fmt.Fprintf(tw, "charges applied\t%d\t\n", applied)
	if err := tw.Flush(); err != nil {
		return err
	}
	if applied != cfg.Orders {
		return fmt.Errorf("%d charges for %d orders", applied, cfg.Orders)
	}
	fmt.Fprintln(out, "every order charged exactly once")
	return nil
}

func placeholders(d dedupe.Dialect) string {
	if d == dedupe.Postgres {
		return "$1, $2"
	}
	return "?, ?"
}
