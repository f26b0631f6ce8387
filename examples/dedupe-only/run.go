package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/sqldb"
)

type config struct {
	// DB is the SQLite file. Empty means a new file in a temporary directory.
	DB string
	// Deliveries is how often the same message is delivered. Defaults to 3.
	Deliveries int
}

const topic = "users.signed_up"

func run(ctx context.Context, cfg config, out io.Writer) error {
	if cfg.Deliveries == 0 {
		cfg.Deliveries = 3
	}
	if cfg.Deliveries < 1 {
		return fmt.Errorf("-deliveries must be >= 1, got %d", cfg.Deliveries)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if cfg.DB == "" {
		dir, err := os.MkdirTemp("", "settle-dedupe-only")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		cfg.DB = filepath.Join(dir, "app.db")
	}

	// WAL, a busy timeout and BEGIN IMMEDIATE: concurrent writers wait for
	// each other instead of failing.
	db, err := sql.Open("sqlite", "file:"+cfg.DB+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close()

	// In a service these statements belong in your migrations: settle never
	// creates tables by itself.
	store, err := dedupe.NewSQLStore(sqldb.Std(db, sqldb.SQLite), dedupe.SQLConfig{})
	if err != nil {
		return err
	}
	ddl := append(store.Schema(), "CREATE TABLE IF NOT EXISTS welcome_emails (user_id TEXT NOT NULL, sent_at TEXT NOT NULL)")
	for _, stmt := range ddl {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}

	// The existing application: a GoChannel (RabbitMQ in production), a
	// router and a handler with an effect. BlockPublishUntilSubscriberAck
	// makes Publish return only once the delivery was acked, so this program
	// knows when each delivery has settled without sleeping.
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	handler := router.AddConsumerHandler("send-welcome", topic, pubsub, func(msg *message.Message) error {
		userID := string(msg.Payload)
		if _, err := db.ExecContext(msg.Context(), "INSERT INTO welcome_emails (user_id, sent_at) VALUES (?, ?)",
			userID, time.Now().UTC().Format(time.RFC3339)); err != nil {
			return err
		}
		fmt.Fprintf(out, "  handler: welcome e-mail sent to %s\n", userID)
		return nil
	})

	// The only settle piece: claim the message's key (its UUID) before the
	// handler runs, confirm it when the handler succeeds, release it when it
	// fails so that a redelivery still does the work.
	if err := store.Check(ctx); err != nil { // the claims table is there, as the store needs it
		return err
	}
	dd, err := dedupe.NewMiddleware(dedupe.Config{Store: store})
	if err != nil {
		return err
	}
	handler.AddMiddleware(dd)

	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return fmt.Errorf("router: %w", err)
	}

	// The broker delivers one message several times: the same UUID, the
	// same payload.
	uuid := watermill.NewUUID()
	for i := 1; i <= cfg.Deliveries; i++ {
		fmt.Fprintf(out, "delivery %d of message %s\n", i, uuid)
		if err := pubsub.Publish(topic, message.NewMessage(uuid, []byte("user-42"))); err != nil {
			return err
		}
		fmt.Fprintf(out, "  acked\n")
	}
	if err := errors.Join(router.Close(), <-routerDone); err != nil {
		return err
	}

	var sent int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM welcome_emails WHERE user_id = 'user-42'").Scan(&sent); err != nil {
		return err
	}
	fmt.Fprintf(out, "deliveries: %d, welcome e-mails sent: %d\n", cfg.Deliveries, sent)
	if sent != 1 {
		return fmt.Errorf("%d welcome e-mails sent, want 1", sent)
	}
	return nil
}
