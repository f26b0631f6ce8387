package blackhole_test

import (
	"io"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/blackhole"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echo serves one echo listener until the test ends.
func echo(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return ln.Addr().String()
}

func roundTrip(t *testing.T, c net.Conn, within time.Duration) bool {
	t.Helper()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(within))
	buf := make([]byte, 4)
	_, err := io.ReadFull(c, buf)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(buf) == "ping"
}

// A cut passes nothing either way and closes nothing; a heal delivers what
// was held, and a connection accepted while cut reaches the target only
// after the heal.
func TestCutAndHeal(t *testing.T) {
	p, err := blackhole.New(echo(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !roundTrip(t, c, 5*time.Second) {
		t.Fatal("no echo before the cut")
	}
	p.Cut()
	if roundTrip(t, c, 300*time.Millisecond) {
		t.Fatal("echo through a cut proxy")
	}
	late, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	if roundTrip(t, late, 300*time.Millisecond) {
		t.Fatal("a connection made while cut reached the target")
	}
	p.Heal()
	buf := make([]byte, 8) // the held ping and the one sent now
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "pingping" {
		t.Fatalf("after the heal read %q, %v; want the held and the new ping", buf, err)
	}
	buf = buf[:4]
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(late, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("the late connection read %q, %v after the heal", buf, err)
	}
}

// Close ends every connection, cut or not, and leaves no goroutine.
func TestCloseWhileCut(t *testing.T) {
	p, err := blackhole.New(echo(t))
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !roundTrip(t, c, 5*time.Second) {
		t.Fatal("no echo")
	}
	p.Cut()
	_, _ = c.Write([]byte("held"))
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("the client's connection is still open after Close")
	}
}
