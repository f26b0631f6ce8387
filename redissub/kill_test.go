package redissub_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/settle-go/settle/redissub"
)

// The configurations whose redelivery after a kill -9 is measured.
var killConfigs = map[string]struct {
	sub              func(t testing.TB, c *redis.Client, group string) message.Subscriber
	idle, claimEvery time.Duration
}{
	"watermill-redisstream defaults": {func(t testing.TB, c *redis.Client, group string) message.Subscriber {
		return stockSub(t, redisstream.SubscriberConfig{Client: c, ConsumerGroup: group})
	}, redisstream.DefaultMaxIdleTime, redisstream.DefaultClaimInterval},
	"redissub.SubscriberConfig": {func(t testing.TB, c *redis.Client, group string) message.Subscriber {
		return stockSub(t, redissub.SubscriberConfig(c, group))
	}, 30 * time.Second, time.Second},
	"redissub.Subscriber": {func(t testing.TB, c *redis.Client, group string) message.Subscriber {
		return newSub(t, c, redissub.Config{ConsumerGroup: group})
	}, 10 * time.Second, time.Second},
}

const childEnv = "REDISSUB_KILL_CHILD"

// TestKillChild is the consumer that TestKillRedelivery kills: it runs only
// as that test's child process.
func TestKillChild(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("run by TestKillRedelivery")
	}
	var name, stream, group string
	if _, err := fmt.Sscanf(spec, "%q %s %s", &name, &stream, &group); err != nil {
		t.Fatal(err)
	}
	sub := killConfigs[name].sub(t, newClient(t), group)
	ch, err := sub.Subscribe(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("subscribed")
	m := <-ch
	fmt.Println("received", m.UUID)
	select {} // the handler runs until the process is killed
}

// A consumer killed (SIGKILL) while its handler runs leaves the entry
// pending; a live consumer of the group redelivers it once the entry has
// been idle MaxIdleTime, at its next claim (every ClaimInterval): the
// measured time from the kill to the redelivery, per configuration.
func TestKillRedelivery(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("child")
	}
	t.Parallel()
	for name, kc := range killConfigs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			admin := newClient(t)
			stream, group := names(t, admin)
			cmd := exec.Command(os.Args[0], "-test.run=^TestKillChild$", "-test.v")
			cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%q %s %s", childEnv, name, stream, group))
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := make(chan string, 8)
			go func() {
				defer close(lines)
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					lines <- sc.Text()
				}
			}()
			wait := func(prefix string) string {
				t.Helper()
				timeout := time.After(30 * time.Second)
				for {
					select {
					case l, ok := <-lines:
						if !ok {
							t.Fatalf("child ended before %q", prefix)
						}
						if strings.HasPrefix(l, prefix) {
							return l
						}
					case <-timeout:
						_ = cmd.Process.Kill()
						t.Fatalf("child did not print %q", prefix)
					}
				}
			}
			wait("subscribed")
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			publish(t, admin, stream, msg)
			if got := wait("received "); got != "received "+msg.UUID {
				t.Fatalf("child: %q", got)
			}
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			_ = cmd.Wait()
			for range lines {
				// drain
			}

			sub := kc.sub(t, newClient(t), group)
			ch, err := sub.Subscribe(t.Context(), stream)
			if err != nil {
				t.Fatal(err)
			}
			m := receive(t, ch, kc.idle+kc.claimEvery+10*time.Second)
			after := time.Since(killed)
			if m.UUID != msg.UUID {
				t.Fatalf("redelivered %s, want %s", m.UUID, msg.UUID)
			}
			m.Ack()
			waitPending(t, admin, stream, group, 0)
			t.Logf("%s (MaxIdleTime %v, ClaimInterval %v): redelivered %v after the kill", name, kc.idle, kc.claimEvery, after.Round(10*time.Millisecond))
			if after < kc.idle-2*time.Second || after > kc.idle+kc.claimEvery+2*time.Second {
				t.Errorf("redelivered after %v, want between MaxIdleTime and MaxIdleTime + ClaimInterval", after)
			}
		})
	}
}
