package outbox_test

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"sort"
	"strings"
	"sync"
	"testing"
)

// wire is a TCP proxy in front of a PostgreSQL or MySQL server that counts
// the statements clients send through it, read from the protocol's own
// messages: what the server is asked to run, whichever library asks.
//
// On PostgreSQL a statement is a simple Query message, an Execute message
// (Parse, Bind, Describe and Sync of the same query are not counted again)
// or a Close (a prepared statement deallocated). On MySQL it is a command
// packet: COM_QUERY, COM_STMT_EXECUTE (its COM_STMT_PREPARE and
// COM_STMT_CLOSE are the same query), COM_PING, COM_RESET_CONNECTION or
// COM_INIT_DB. Health-check pings of a pool count.
type wire struct {
	ln     net.Listener
	target string
	mysql  bool

	mu     sync.Mutex
	kinds  map[string]int
	n      int
	conns  []net.Conn
	closed bool
	wg     sync.WaitGroup
}

// newWire starts a proxy to the server of rawURL (postgres:// or mysql://)
// and returns the URL that reaches it through the proxy. It stops when the
// test ends.
func newWire(t *testing.T, rawURL string) (*wire, string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal("the database URL does not parse")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w := &wire{ln: ln, target: u.Host, mysql: u.Scheme == "mysql", kinds: map[string]int{}}
	u.Host = ln.Addr().String()
	w.wg.Go(w.accept)
	t.Cleanup(w.close)
	return w, u.String()
}

// statements is how many statements went through so far.
func (w *wire) statements() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n
}

// messages lists the messages counted so far by kind, for failure reports.
func (w *wire) messages() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var parts []string
	for k, n := range w.kinds {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

func (w *wire) close() {
	w.mu.Lock()
	w.closed = true
	_ = w.ln.Close()
	for _, c := range w.conns {
		_ = c.Close()
	}
	w.mu.Unlock()
	w.wg.Wait()
}

func (w *wire) track(c net.Conn) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		_ = c.Close()
		return false
	}
	w.conns = append(w.conns, c)
	return true
}

func (w *wire) count(kind string, statement bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.kinds[kind]++
	if statement {
		w.n++
	}
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
		if !w.track(c) || !w.track(s) {
			_ = c.Close()
			_ = s.Close()
			return
		}
		w.wg.Go(func() {
			_, _ = io.Copy(c, s)
			_ = c.Close()
		})
		w.wg.Go(func() {
			r := io.TeeReader(c, s)
			if w.mysql {
				_ = w.readMySQL(bufio.NewReader(r))
			} else {
				_ = w.readPostgres(bufio.NewReader(r))
			}
			_, _ = io.Copy(s, c) // whatever the parser left (an error)
			_ = s.Close()
		})
	}
}

// readPostgres reads the frontend's messages: untyped ones until the
// startup message (an SSL or GSS request may come first; a cancel request
// comes alone), then typed ones.
func (w *wire) readPostgres(r *bufio.Reader) error {
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
		switch code {
		case 80877103, 80877104: // SSLRequest, GSSENCRequest: refused (sslmode=disable)
			continue
		case 80877102:
			w.count("CancelRequest", false)
			return nil
		}
		break
	}
	names := map[byte]string{'Q': "Query", 'P': "Parse", 'B': "Bind", 'D': "Describe", 'E': "Execute", 'S': "Sync", 'C': "Close", 'H': "Flush", 'X': "Terminate", 'p': "Password"}
	for {
		if _, err := io.ReadFull(r, hdr[:5]); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[1:5]))
		if _, err := r.Discard(n - 4); err != nil {
			return err
		}
		name := names[hdr[0]]
		if name == "" {
			name = string(hdr[:1])
		}
		w.count(name, hdr[0] == 'Q' || hdr[0] == 'E' || hdr[0] == 'C')
	}
}

// readMySQL reads the client's packets: a command starts a new sequence
// (sequence id 0); the handshake's packets do not.
func (w *wire) readMySQL(r *bufio.Reader) error {
	var hdr [5]byte
	names := map[byte]string{0x01: "COM_QUIT", 0x02: "COM_INIT_DB", 0x03: "COM_QUERY", 0x0e: "COM_PING", 0x16: "COM_STMT_PREPARE", 0x17: "COM_STMT_EXECUTE", 0x19: "COM_STMT_CLOSE", 0x1f: "COM_RESET_CONNECTION"}
	for {
		if _, err := io.ReadFull(r, hdr[:4]); err != nil {
			return err
		}
		n := int(hdr[0]) | int(hdr[1])<<8 | int(hdr[2])<<16
		if hdr[3] != 0 || n == 0 {
			if _, err := r.Discard(n); err != nil {
				return err
			}
			continue
		}
		cmd, err := r.ReadByte()
		if err != nil {
			return err
		}
		if _, err := r.Discard(n - 1); err != nil {
			return err
		}
		name := names[cmd]
		if name == "" {
			name = fmt.Sprintf("COM_%#x", cmd)
		}
		switch cmd {
		case 0x02, 0x03, 0x0e, 0x17, 0x1f:
			w.count(name, true)
		default:
			w.count(name, false)
		}
	}
}
