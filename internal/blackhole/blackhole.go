// Package blackhole is a TCP proxy for tests that simulates a silent network
// partition: it listens on 127.0.0.1, forwards every connection it accepts
// to a target address, and on Cut stops forwarding bytes in both directions
// without closing anything, as a link whose packets are dropped would; Heal
// forwards again, bytes held meanwhile included.
//
// Both ends see a live TCP connection throughout: the client's kernel gets
// its bytes acknowledged by the proxy's, so neither TCP keepalive nor
// TCP_USER_TIMEOUT on the client notices the cut; only the deadlines and the
// server's own timeouts of the program under test can. A connection accepted
// while cut is not dialled to the target until healed (its handshake hangs,
// as a connect into a dropped route does). A close of either end while cut
// is held too, and passed on at Heal.
package blackhole

import (
	"errors"
	"io"
	"net"
	"sync"
)

// Proxy forwards connections to one target until cut. Close ends it.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	cut    bool
	healed *sync.Cond // broadcast on Heal and Close
	closed bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// New listens on a free port of 127.0.0.1 and forwards to target.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.healed = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Cut stops forwarding: from now on no byte passes in either direction, and
// nothing is closed.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut = true
	p.mu.Unlock()
}

// Heal forwards again.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.cut = false
	p.healed.Broadcast()
	p.mu.Unlock()
}

// Close stops listening, closes every connection (both ends) and waits for
// the proxy's goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.healed.Broadcast()
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

// pass waits while the proxy is cut and reports whether it is still open.
func (p *Proxy) pass() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.cut && !p.closed {
		p.healed.Wait()
	}
	return !p.closed
}

// track records c so that Close closes it; false when already closed.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve forwards one client connection.
func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.untrack(client)
	if !p.pass() {
		return
	}
	server, err := net.Dial("tcp", p.target)
	if err != nil || !p.track(server) {
		return
	}
	defer p.untrack(server)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.forward(server, client) }()
	go func() { defer wg.Done(); p.forward(client, server) }()
	wg.Wait()
}

// forward copies src to dst while not cut. At src's end (or an error) it
// closes dst, once the proxy is not cut, and so ends the other direction.
func (p *Proxy) forward(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if !p.pass() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				_ = src.Close()
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				_ = dst.Close()
			} else {
				_ = dst.Close()
				_ = src.Close()
			}
			return
		}
	}
}
