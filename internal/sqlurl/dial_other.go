//go:build !linux

package sqlurl

import (
	"syscall"
	"time"
)

// userTimeout does nothing where TCP_USER_TIMEOUT is not known.
func userTimeout(time.Duration) func(network, address string, c syscall.RawConn) error { return nil }
