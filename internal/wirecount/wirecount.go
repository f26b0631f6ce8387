// Package wirecount is a TCP proxy in front of a PostgreSQL or MySQL server
// that counts the statements its clients send, read from the protocol's own
// messages: what the server is asked to run, whichever library asks, the
// pools' health-check pings included (a driver's tracer does not see
// those). The outbox's tests and the outbox benchmark count an idle relay's
// statements with it.
//
// On PostgreSQL a statement is a simple Query message, an Execute message
// (the Parse, Bind, Describe and Sync of the same query are not counted
// again) or a Close (a prepared statement deallocated). On MySQL it is a
// command packet: COM_QUERY, COM_STMT_EXECUTE (its COM_STMT_PREPARE and
// COM_STMT_CLOSE are the same query), COM_PING, COM_RESET_CONNECTION or
// COM_INIT_DB.
//
// On PostgreSQL the proxy also knows which of its connections sent a LISTEN
// (as a simple Query or a Parse), and the port each connection has on the
// server's side, which is pg_stat_activity.client_port: a test finds the
// backend that LISTENs that way, and can terminate it.
//
// The proxy reads the messages in clear: it asks PostgreSQL clients for
// sslmode=disable and does not work under TLS.
package wirecount

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"sort"
	"strings"
	"sync"
)

// Proxy counts the statements that go through it. Its methods are safe for
// concurrent use.
type Proxy struct {
	ln     net.Listener
	target string
	mysql  bool

	mu     sync.Mutex
	kinds  map[string]int
	n      int64
	conns  []net.Conn
	open   map[*conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// conn is one client's connection through the proxy.
type conn struct {
	serverPort int  // the proxy's port on its connection to the server
	listens    bool // it sent a LISTEN
}

// Start starts a proxy to the server of rawURL (postgres://, postgresql://
// or mysql://) and returns it with the URL that reaches the server through
// it (with sslmode=disable on PostgreSQL). Close stops it.
func Start(rawURL string) (*Proxy, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("wirecount: the database URL does not parse")
	}
	p := &Proxy{target: u.Host, kinds: map[string]int{}, open: map[*conn]struct{}{}}
	switch u.Scheme {
	case "mysql":
		p.mysql = true
	case "postgres", "postgresql":
		q := u.Query()
		q.Set("sslmode", "disable") // the proxy reads the messages in clear
		u.RawQuery = q.Encode()
	default:
		return nil, "", fmt.Errorf("wirecount: URL scheme %q is neither PostgreSQL's nor MySQL's", u.Scheme)
	}
	if p.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		return nil, "", err
	}
	u.Host = p.ln.Addr().String()
	p.wg.Go(p.accept)
	return p, u.String(), nil
}

// Statements is how many statements went through so far.
func (p *Proxy) Statements() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// Messages lists the messages read so far by kind ("Query=3 Sync=2"), for
// failure reports.
func (p *Proxy) Messages() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	parts := make([]string, 0, len(p.kinds))
	for k, n := range p.kinds {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// Listening returns the server-side ports (pg_stat_activity.client_port) of
// the open connections that sent a LISTEN, in increasing order. A
// connection the server closed stays listed until the proxy has seen it
// end.
func (p *Proxy) Listening() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ports []int
	for c := range p.open {
		if c.listens {
			ports = append(ports, c.serverPort)
		}
	}
	sort.Ints(ports)
	return ports
}

// Close stops the proxy, closes its connections and waits for its
// goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	_ = p.ln.Close()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range cs {
			_ = c.Close()
		}
		return false
	}
	p.conns = append(p.conns, cs...)
	return true
}

func (p *Proxy) count(kind string, statement bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.kinds[kind]++
	if statement {
		p.n++
	}
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		if !p.track(c, s) {
			return
		}
		cn := &conn{}
		if a, ok := s.LocalAddr().(*net.TCPAddr); ok {
			cn.serverPort = a.Port
		}
		p.mu.Lock()
		p.open[cn] = struct{}{}
		p.mu.Unlock()
		var both sync.WaitGroup
		both.Go(func() {
			_, _ = io.Copy(c, s)
			_ = c.Close()
		})
		both.Go(func() {
			// The tee forwards what the parser reads as it reads it.
			r := bufio.NewReader(io.TeeReader(c, s))
			if p.mysql {
				_ = p.readMySQL(r)
			} else {
				_ = p.readPostgres(r, cn)
			}
			_, _ = io.Copy(s, c) // whatever the parser left (an error)
			_ = s.Close()
		})
		p.wg.Go(func() {
			both.Wait()
			p.mu.Lock()
			delete(p.open, cn)
			p.mu.Unlock()
		})
	}
}

// pgNames are the PostgreSQL frontend messages by type byte.
var pgNames = map[byte]string{'Q': "Query", 'P': "Parse", 'B': "Bind", 'D': "Describe", 'E': "Execute", 'S': "Sync", 'C': "Close", 'H': "Flush", 'X': "Terminate", 'p': "Password"}

// readPostgres reads the frontend's messages: untyped ones until the
// startup message (an SSL or GSS request may come first; a cancel request
// comes alone), then typed ones.
func (p *Proxy) readPostgres(r *bufio.Reader, cn *conn) error {
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
		if code == 80877102 {
			p.count("CancelRequest", false)
			return nil
		}
		if code != 80877103 && code != 80877104 { // not SSLRequest, GSSENCRequest (refused: sslmode=disable)
			break
		}
	}
	var body []byte
	for {
		if _, err := io.ReadFull(r, hdr[:5]); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[1:5])) - 4
		typ := hdr[0]
		if typ == 'Q' || typ == 'P' {
			// Read the text, to see a LISTEN.
			if cap(body) < n {
				body = make([]byte, n)
			}
			body = body[:n]
			if _, err := io.ReadFull(r, body); err != nil {
				return err
			}
			if typ == 'P' { // the statement's name comes first
				if i := bytes.IndexByte(body, 0); i >= 0 {
					body = body[i+1:]
				}
			}
			if isListen(body) {
				p.mu.Lock()
				cn.listens = true
				p.mu.Unlock()
			}
		} else if _, err := r.Discard(n); err != nil {
			return err
		}
		name := pgNames[typ]
		if name == "" {
			name = string(hdr[:1])
		}
		p.count(name, typ == 'Q' || typ == 'E' || typ == 'C')
	}
}

// isListen reports whether the query text starts with LISTEN.
func isListen(q []byte) bool {
	q = bytes.TrimLeft(q, " \t\r\n")
	return len(q) > len("LISTEN") && bytes.EqualFold(q[:len("LISTEN")], []byte("LISTEN")) &&
		strings.ContainsRune(" \t\r\n\"", rune(q[len("LISTEN")]))
}

// mysqlNames are the MySQL commands by their first byte.
var mysqlNames = map[byte]string{0x01: "COM_QUIT", 0x02: "COM_INIT_DB", 0x03: "COM_QUERY", 0x0e: "COM_PING", 0x16: "COM_STMT_PREPARE", 0x17: "COM_STMT_EXECUTE", 0x19: "COM_STMT_CLOSE", 0x1f: "COM_RESET_CONNECTION"}

// readMySQL reads the client's packets: a command starts a new sequence
// (sequence id 0); the handshake's packets do not.
func (p *Proxy) readMySQL(r *bufio.Reader) error {
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
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
		name := mysqlNames[cmd]
		if name == "" {
			name = fmt.Sprintf("COM_%#x", cmd)
		}
		switch cmd {
		case 0x02, 0x03, 0x0e, 0x17, 0x1f:
			p.count(name, true)
		default:
			p.count(name, false)
		}
	}
}
