package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

type config struct {
	// DB is the SQLite file. Empty means a new file in a temporary directory.
	DB string
	// Serve listens on Addr until ctx is done, instead of sending the demo
	// requests through an in-process test server.
	Serve bool
	Addr  string
}

const placedTopic = "orders.placed"

type order struct {
	ID  string `json:"id"`
	SKU string `json:"sku"`
	Qty int    `json:"qty"`
}

var errOutOfStock = errors.New("not enough stock")

func run(ctx context.Context, cfg config, w io.Writer) error {
	out := &lockedWriter{w: w} // the consumer prints from its own goroutine
	if cfg.DB == "" {
		dir, err := os.MkdirTemp("", "settle-outbox-http")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		cfg.DB = filepath.Join(dir, "shop.db")
	}
	db, err := sql.Open("sqlite", "file:"+cfg.DB+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()

	// The outbox: its tables live next to the application's. In a service,
	// ob.Schema() goes into the migrations.
	ob, err := outbox.New(sqldb.Std(db, sqldb.SQLite), outbox.Config{})
	if err != nil {
		return err
	}
	if err := ob.InitSchema(ctx); err != nil {
		return err
	}
	for _, stmt := range []string{
		"CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL)",
		"CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)",
		"INSERT INTO stock (sku, qty) VALUES ('mug', 5) ON CONFLICT (sku) DO NOTHING",
	} {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}

	logger := watermill.NopLogger{}
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer broker.Close()

	// The consumer. The relay delivers at least once: in a service, put the
	// dedupe middleware on this handler (see examples/dedupe-only).
	var consumed atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("print-orders", placedTopic, broker, func(msg *message.Message) error {
		var o order
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return err
		}
		fmt.Fprintf(out, "consumer: order %s placed, %d x %s\n", o.ID, o.Qty, o.SKU)
		consumed.Add(1)
		return nil
	})

	// The relay: committed outbox rows to the broker.
	relay, err := ob.NewRelay(broker, outbox.RelayConfig{})
	if err != nil {
		return err
	}

	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	routerDone, relayDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	go func() { relayDone <- relay.Run(runCtx) }()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		return errors.Join(relay.Close(), <-relayDone, router.Close(), <-routerDone)
	}
	defer func() { _ = stop() }()
	<-router.Running()
	<-relay.Running()

	mux := http.NewServeMux()
	mux.Handle("POST /orders", placeOrderHandler(db, ob))

	if cfg.Serve {
		return serve(ctx, cfg.Addr, mux, out)
	}

	// The demo: requests through an in-process server, as a client would
	// send them.
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	srv := httptest.NewServer(mux)
	defer srv.Close()
	requests := []string{
		`{"id":"A-1","sku":"mug","qty":2}`,
		`{"id":"A-2","sku":"mug","qty":3}`,
		`{"id":"A-3","sku":"mug","qty":1}`, // the stock is used up: rolled back
		`{"id":"A-4","sku":"mug","qty":0}`, // refused before any transaction
	}
	for _, body := range requests {
		resp, err := srv.Client().Post(srv.URL+"/orders", "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		text, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Fprintf(out, "POST /orders %s -> %s\n", body, strings.TrimSpace(resp.Status+" "+string(text)))
	}

	// Wait until the relay has forwarded every committed row: no sleeping,
	// no guessing.
	if err := relay.Drain(ctx); err != nil {
		return err
	}
	forwarded, _ := relay.Counts()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for consumed.Load() < forwarded {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return fmt.Errorf("consumed %d of %d events: %w", consumed.Load(), forwarded, ctx.Err())
		}
	}
	if err := stop(); err != nil {
		return err
	}
	var orders int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM orders").Scan(&orders); err != nil {
		return err
	}
	fmt.Fprintf(out, "orders in the database: %d, events forwarded by the relay: %d\n", orders, forwarded)
	if int64(orders) != forwarded {
		return fmt.Errorf("%d orders but %d events", orders, forwarded)
	}
	return nil
}

// placeOrderHandler writes the order, publishes its event and reserves the
// stock in one transaction.
func placeOrderHandler(db *sql.DB, ob *outbox.Outbox[*sql.Tx]) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o order
		if err := json.NewDecoder(r.Body).Decode(&o); err != nil || o.ID == "" || o.SKU == "" || o.Qty <= 0 {
			http.Error(w, "want {\"id\", \"sku\", \"qty\" > 0}", http.StatusBadRequest)
			return
		}
		err := placeOrder(r.Context(), db, ob, o)
		switch {
		case errors.Is(err, errOutOfStock):
			http.Error(w, err.Error(), http.StatusConflict)
		case err != nil:
			http.Error(w, "could not place the order", http.StatusInternalServerError)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
}

// placeOrder commits the order row, the outbox row of its event and the
// stock reservation together, or none of them.
func placeOrder(ctx context.Context, db *sql.DB, ob *outbox.Outbox[*sql.Tx], o order) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // a no-op after Commit

	if _, err := tx.ExecContext(ctx, "INSERT INTO orders (id, sku, qty) VALUES (?, ?, ?)", o.ID, o.SKU, o.Qty); err != nil {
		return err
	}
	payload, err := json.Marshal(o)
	if err != nil {
		return err
	}
	event := message.NewMessage("order-placed-"+o.ID, payload)
	event.SetContext(ctx) // the request's trace continues in the consumer
	pub, err := ob.TxPublisher(tx)
	if err != nil {
		return err
	}
	if err := pub.Publish(placedTopic, event); err != nil {
		return err
	}

	// Validation that needs the database, after the writes: if it fails,
	// the rollback takes the order row and the event with it.
	res, err := tx.ExecContext(ctx, "UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?", o.Qty, o.SKU, o.Qty)
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil {
		return err
	} else if n == 0 {
		return fmt.Errorf("order %s: %w for %d x %s", o.ID, errOutOfStock, o.Qty, o.SKU)
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	ob.Notify() // the relay of this process forwards at once
	return nil
}

// serve listens on addr until ctx is done.
func serve(ctx context.Context, addr string, h http.Handler, out io.Writer) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	fmt.Fprintf(out, "listening on http://%s (POST /orders); interrupt to stop\n", ln.Addr())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
