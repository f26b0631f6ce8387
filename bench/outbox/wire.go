package main

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
)

// wire is a TCP proxy in front of PostgreSQL that counts the statements its
// clients send, read from the protocol's messages: a simple Query, an
// Execute (the Parse, Bind, Describe and Sync of the same query are not
// counted again) or a Close (a prepared statement deallocated). What a
// pgx tracer does not see, the pools' health-check pings among them, is
// counted here. The outbox package's TestIdleRelayOnTheWire counts the
// same way.
type wire struct {
	ln     net.Listener
	target string
	n      atomic.Int64

	mu     sync.Mutex
	conns  []net.Conn
	closed bool
	wg     sync.WaitGroup
}

// newWire starts a proxy to the server of dbURL and returns the URL that
// reaches it through the proxy.
func newWire(dbURL string) (*wire, string, error) {
	u, err := url.Parse(dbURL)
	if err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	w := &wire{ln: ln, target: u.Host}
	u.Host = ln.Addr().String()
	q := u.Query()
	q.Set("sslmode", "disable") // the proxy reads the messages in clear
	u.RawQuery = q.Encode()
	w.wg.Go(w.accept)
	return w, u.String(), nil
}

// Close stops the proxy and closes its connections.
func (w *wire) Close() {
	w.mu.Lock()
	w.closed = true
	_ = w.ln.Close()
	for _, c := range w.conns {
		_ = c.Close()
	}
	w.mu.Unlock()
	w.wg.Wait()
}

func (w *wire) track(cs ...net.Conn) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		for _, c := range cs {
			_ = c.Close()
		}
		return false
	}
	w.conns = append(w.conns, cs...)
	return true
}

func (w *wire) accept() {
	for {
		c, err := w.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", w.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		if !w.track(c, s) {
			return
		}
		w.wg.Go(func() {
			_, _ = io.Copy(c, s)
			_ = c.Close()
		})
		w.wg.Go(func() {
			// The tee forwards what the parser reads as it reads it.
			_ = w.read(bufio.NewReader(io.TeeReader(c, s)))
			_, _ = io.Copy(s, c)
			_ = s.Close()
		})
	}
}

// read reads the frontend's messages: untyped ones until the startup
// message (an SSL or GSS request may come first; a cancel request comes
// alone), then typed ones.
func (w *wire) read(r *bufio.Reader) error {
	var hdr [8]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[:4]))
		code := binary.BigEndian.Uint32(hdr[4:])
		if _, err := r.Discard(n - 8); err != nil {
			return err
		}
		if code == 80877102 { // CancelRequest
			return nil
		}
		if code != 80877103 && code != 80877104 { // not SSLRequest, GSSENCRequest
			break
		}
	}
	for {
		if _, err := io.ReadFull(r, hdr[:5]); err != nil {
			return err
		}
		if _, err := r.Discard(int(binary.BigEndian.Uint32(hdr[1:5])) - 4); err != nil {
			return err
		}
		switch hdr[0] {
		case 'Q', 'E', 'C':
			w.n.Add(1)
		}
	}
}
