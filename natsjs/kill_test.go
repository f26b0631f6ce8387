package natsjs_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/natsjs"
)

const (
	killAckWait = time.Second
	helperEnv   = "NATSJS_KILL_HELPER" // "<mode> <url> <topic>"
)

// killSubscriber is the subscriber of one mode: natsjs's, or watermill-nats
// configured as its README shows (durable, queue group, AckWaitTimeout),
// which nats.go auto-acks.
func killSubscriber(t testing.TB, mode, url string) message.Subscriber {
	t.Helper()
	var (
		sub message.Subscriber
		err error
	)
	switch mode {
	case "natsjs":
		sub, err = natsjs.NewSubscriber(url, natsjs.Config{Durable: "kill", AckWait: killAckWait}, watermill.NopLogger{})
	case "stock":
		sub, err = wmnats.NewSubscriber(wmnats.SubscriberConfig{
			URL: url, QueueGroupPrefix: "kill", AckWaitTimeout: killAckWait,
			JetStream: wmnats.JetStreamConfig{DurablePrefix: "kill"},
		}, watermill.NopLogger{})
	default:
		t.Fatalf("mode %q", mode)
	}
	if err != nil {
		t.Fatal(err)
	}
	return sub
}

// TestKillHelper is the consumer the kill test starts in a process of its
// own: it says when its handler has started, and the handler never ends.
func TestKillHelper(t *testing.T) {
	args := strings.Fields(os.Getenv(helperEnv))
	if len(args) != 3 {
		return // run by TestKillMidHandler only
	}
	mode, url, topic := args[0], args[1], args[2]
	sub := killSubscriber(t, mode, url)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 300 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddConsumerHandler("kill", topic, sub, func(msg *message.Message) error {
		fmt.Printf("started %s\n", msg.UUID)
		select {} // killed here
	})
	// SIGTERM: the router shuts down (its handler does not end), and the
	// process is then killed.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	go func() {
		<-sig
		_ = r.Close()
		fmt.Println("closed")
	}()
	_ = r.Run(context.Background())
	select {}
}

// A consumer whose handler has run past watermill-nats' AckWaitTimeout is
// killed (SIGKILL), directly or after a shutdown that its handler outlives
// (the router's CloseTimeout passes): with natsjs's configuration JetStream
// delivers the message again and a second consumer does the work. With
// watermill-nats configured without nats.ManualAck, nats.go acked the
// message when the subscriber stopped waiting for the router, and it is
// gone. (natsjs's subscriber waits for the router without end, so only the
// shutdown makes it stop waiting: there nats.ManualAck is what keeps the
// message.)
func TestKillMidHandler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode     string
		shutdown bool // SIGTERM before SIGKILL
		redone   bool
	}{
		{"natsjs", false, true},
		{"natsjs", true, true},
		// No shutdown: the stock subscriber's Unsubscribe deletes the
		// consumer nats.go created, and the second consumer would start the
		// stream over.
		{"stock", false, false},
	} {
		t.Run(fmt.Sprintf("%s/shutdown=%v", tc.mode, tc.shutdown), func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			e.publish(t, message.NewMessage("work-1", []byte("{}")))

			cmd := exec.Command(os.Args[0], "-test.run=^TestKillHelper$", "-test.count=1")
			cmd.Env = append(os.Environ(), helperEnv+"="+tc.mode+" "+e.url+" "+e.topic)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
			started, closed := make(chan struct{}), make(chan struct{})
			go func() {
				s := bufio.NewScanner(out)
				var once, onceClosed bool
				for s.Scan() {
					if strings.HasPrefix(s.Text(), "started work-1") && !once {
						once = true
						close(started)
					}
					if s.Text() == "closed" && !onceClosed {
						onceClosed = true
						close(closed)
					}
				}
			}()
			select {
			case <-started:
			case <-time.After(20 * time.Second):
				t.Fatal("the helper's handler did not start")
			}
			// Past watermill-nats' AckWaitTimeout (the stock configuration
			// waits for the router no longer), then a shutdown that the
			// handler outlives, then SIGKILL.
			time.Sleep(killAckWait + 700*time.Millisecond)
			if tc.shutdown {
				if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				select {
				case <-closed:
				case <-time.After(10 * time.Second):
					t.Fatal("the helper's router did not close")
				}
			}
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			_ = cmd.Wait()

			sub := killSubscriber(t, tc.mode, e.url)
			t.Cleanup(func() { _ = sub.Close() })
			ch := subscribe(t, sub, e.topic)
			select {
			case m := <-ch:
				m.Ack()
				if !tc.redone {
					t.Fatalf("%s delivered again to the second consumer; this test's premise (the stock configuration loses it) no longer holds", m.UUID)
				}
			case <-time.After(4 * killAckWait):
				if tc.redone {
					t.Fatal("the message of the killed consumer never came back: lost")
				}
				ci, err := e.js.ConsumerInfo(e.topic, "kill")
				if err != nil {
					t.Fatal(err)
				}
				if ci.AckFloor.Stream != 1 || ci.NumAckPending != 0 {
					t.Fatalf("stock: ack floor %d, %d unacked: want the unfinished message acked", ci.AckFloor.Stream, ci.NumAckPending)
				}
			}
		})
	}
}
