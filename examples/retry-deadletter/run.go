package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
	"github.com/settle-go/settle/poison"
)

type config struct {
	// Timeout bounds the run. Defaults to 30s.
	Timeout time.Duration
}

const (
	topic           = "invoices"
	deadLetterTopic = "invoices.dead_letter"
	poisonTopic     = "invoices.poison"
)

// How each invoice behaves: it fails on attempts before okFrom, and
// permanently when permanent is set. okFrom 0 means it never succeeds.
var invoices = []struct {
	id        string
	okFrom    int
	permanent bool
}{
	{id: "inv-1", okFrom: 1},
	{id: "inv-2", okFrom: 2},       // the mail server drops the first connection
	{id: "inv-3", okFrom: 3},       // ... the first two
	{id: "inv-4", permanent: true}, // no customer e-mail address: no retry can fix it
	{id: "inv-5"},                  // the mail server refuses it every time
}

// ending is where a message ended, as this program saw it.
type ending struct {
	id, where string
	attempt   string
	copy      *message.Message // the dead-letter or poison copy
}

func run(ctx context.Context, cfg config, out io.Writer) error {
	if cfg.Timeout == 0 {
		cfg.Timeout = 30 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer pubsub.Close()

	// The parking middleware first, then the retry: poison and dead-letter
	// parking only park what the retry gave up on.
	ps, err := middleware.NewPoison(middleware.ParkConfig{Publisher: pubsub, Topic: poisonTopic})
	if err != nil {
		return err
	}
	dl, err := middleware.NewDeadLetter(middleware.ParkConfig{Publisher: pubsub, Topic: deadLetterTopic})
	if err != nil {
		return err
	}
	retry, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts:      3,
		InProcessRetries: 1,                     // two attempts per delivery ...
		InitialInterval:  10 * time.Millisecond, // ... 10ms apart,
		RedeliveryDelay:  50 * time.Millisecond, // then back to the broker
	})
	if err != nil {
		return err
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	done := make(chan ending, len(invoices))
	router.AddConsumerHandler("send-invoice", topic, pubsub, func(msg *message.Message) error {
		id := string(msg.Payload)
		// The retry middleware sets settle_attempt before each run: 1, 2, ...
		attempt, err := strconv.Atoi(msg.Metadata.Get(settle.MetaAttempt))
		if err != nil {
			return err
		}
		for _, inv := range invoices {
			if inv.id != id {
				continue
			}
			switch {
			case inv.permanent:
				return poison.Permanent(fmt.Errorf("invoice %s has no customer e-mail address", id))
			case inv.okFrom == 0 || attempt < inv.okFrom:
				return fmt.Errorf("smtp: 421 try again later (invoice %s, attempt %d)", id, attempt)
			}
			done <- ending{id: id, where: "done", attempt: strconv.Itoa(attempt)}
			return nil
		}
		return poison.Permanent(fmt.Errorf("unknown invoice %q", id))
	}).AddMiddleware(ps, dl, retry) // outermost first

	dead, err := pubsub.Subscribe(ctx, deadLetterTopic)
	if err != nil {
		return err
	}
	poisoned, err := pubsub.Subscribe(ctx, poisonTopic)
	if err != nil {
		return err
	}
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	defer func() { _ = router.Close() }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return fmt.Errorf("router: %w", err)
	}

	for _, inv := range invoices {
		if err := pubsub.Publish(topic, message.NewMessage(inv.id, []byte(inv.id))); err != nil {
			return err
		}
	}

	// Every message ends in one place: done, the dead-letter topic or the
	// poison topic. Wait for all of them.
	var ends []ending
	for len(ends) < len(invoices) {
		select {
		case e := <-done:
			ends = append(ends, e)
		case m := <-dead:
			m.Ack()
			ends = append(ends, ending{id: m.UUID, where: "dead-letter topic", attempt: m.Metadata.Get(settle.MetaAttempt), copy: m})
		case m := <-poisoned:
			m.Ack()
			ends = append(ends, ending{id: m.UUID, where: "poison topic", attempt: m.Metadata.Get(settle.MetaAttempt), copy: m})
		case <-ctx.Done():
			return fmt.Errorf("%d of %d messages settled: %w", len(ends), len(invoices), ctx.Err())
		}
	}
	if err := errors.Join(router.Close(), <-routerDone); err != nil {
		return err
	}

	sort.Slice(ends, func(i, j int) bool { return ends[i].id < ends[j].id })
	fmt.Fprintln(out, "where each invoice ended:")
	for _, e := range ends {
		fmt.Fprintf(out, "  %s  %-17s  after %s attempt(s)\n", e.id, e.where, e.attempt)
	}
	for _, e := range ends {
		if e.copy == nil {
			continue
		}
		fmt.Fprintf(out, "\n%s copy of %s:\n", e.where, e.id)
		keys := make([]string, 0, len(e.copy.Metadata))
		for k := range e.copy.Metadata {
			if strings.HasPrefix(k, "settle_") {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(out, "  %-24s %s\n", k, e.copy.Metadata.Get(k))
		}
	}
	return nil
}
