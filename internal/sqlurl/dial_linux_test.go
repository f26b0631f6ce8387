package sqlurl_test

import (
	"net"
	"syscall"
	"testing"

	"github.com/settle-go/settle/internal/sqlurl"
)

// The connections settle dials carry TCP_USER_TIMEOUT and keepalive, so
// that the kernel gives up on a peer that vanished silently in bounded
// time.
func TestDialerSetsUserTimeoutAndKeepAlive(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := sqlurl.Dialer().DialContext(t.Context(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var userTimeout, keepAlive, idle int
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		userTimeout, gerr = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, 0x12) // TCP_USER_TIMEOUT
		if gerr == nil {
			keepAlive, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_KEEPALIVE)
		}
		if gerr == nil {
			idle, gerr = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)
		}
	}); err != nil || gerr != nil {
		t.Fatal(err, gerr)
	}
	if userTimeout != int(sqlurl.UserTimeout.Milliseconds()) || keepAlive != 1 || idle != int(sqlurl.KeepAliveIdle.Seconds()) {
		t.Fatalf("TCP_USER_TIMEOUT %dms, SO_KEEPALIVE %d, TCP_KEEPIDLE %ds; want %v, on, %v", userTimeout, keepAlive, idle, sqlurl.UserTimeout, sqlurl.KeepAliveIdle)
	}
}
