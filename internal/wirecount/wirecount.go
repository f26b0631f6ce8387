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
			// The parser forwards each message once it has counted it, so
			// that a client that has its answer finds it counted.
			r := bufio.NewReader(c)
			if p.mysql {
				_ = p.readMySQL(r, s)
			} else {
				_ = p.readPostgres(r, s, cn)
			}
			_, _ = io.Copy(s, r) // whatever the parser left (an error)
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

// readPostgres reads the frontend's messages and forwards each to w: untyped
// ones until the startup message (an SSL or GSS request may come first; a
// cancel request comes alone), then typed ones.
func (p *Proxy) readPostgres(r *bufio.Reader, w io.Writer, cn *conn) error {
	var msg []byte
	for {
		var err error
		if msg, err = readMsg(r, msg, 4, 0); err != nil {
			return err
		}
		code := binary.BigEndian.Uint32(msg[4:8])
		if code == 80877102 {
			p.count("CancelRequest", false)
			_, err = w.Write(msg)
			return err
		}
		if _, err := w.Write(msg); err != nil {
			return err
		}
		if code != 80877103 && code != 80877104 { // not SSLRequest, GSSENCRequest (refused: sslmode=disable)
			break
		}
	}
	for {
		var err error
		if msg, err = readMsg(r, msg, 5, 1); err != nil {
			return err
		}
		typ := msg[0]
		body := msg[5:]
		if typ == 'P' { // the statement's name comes first
			if i := bytes.IndexByte(body, 0); i >= 0 {
				body = body[i+1:]
			}
		}
		if (typ == 'Q' || typ == 'P') && isListen(body) {
			p.mu.Lock()
			cn.listens = true
			p.mu.Unlock()
		}
		name := pgNames[typ]
		if name == "" {
			name = string(msg[:1])
		}
		p.count(name, typ == 'Q' || typ == 'E' || typ == 'C')
		if _, err := w.Write(msg); err != nil {
			return err
		}
	}
}

// readMsg reads one PostgreSQL message into buf: a header of hdr bytes whose
// 4-byte big-endian length starts at lenAt and counts itself and the body.
func readMsg(r *bufio.Reader, buf []byte, hdr, lenAt int) ([]byte, error) {
	buf = append(buf[:0], make([]byte, hdr)...)
	if _, err := io.ReadFull(r, buf); err != nil {
		return buf, err
	}
	n := lenAt + int(binary.BigEndian.Uint32(buf[lenAt:lenAt+4]))
	if n < hdr {
		return buf, fmt.Errorf("wirecount: message length %d", n)
	}
	buf = append(buf, make([]byte, n-hdr)...)
	_, err := io.ReadFull(r, buf[hdr:])
	return buf, err
}

// isListen reports whether the query text starts with LISTEN.
func isListen(q []byte) bool {
	q = bytes.TrimLeft(q, " \t\r\n")
	return len(q) > len("LISTEN") && bytes.EqualFold(q[:len("LISTEN")], []byte("LISTEN")) &&
		strings.ContainsRune(" \t\r\n\"", rune(q[len("LISTEN")]))
}

// mysqlNames are the MySQL commands by their first byte.
var mysqlNames = map[byte]string{0x01: "COM_QUIT", 0x02: "COM_INIT_DB", 0x03: "COM_QUERY", 0x0e: "COM_PING", 0x16: "COM_STMT_PREPARE", 0x17: "COM_STMT_EXECUTE", 0x19: "COM_STMT_CLOSE", 0x1f: "COM_RESET_CONNECTION"}

// readMySQL reads the client's packets and forwards each to w: a command
// starts a new sequence (sequence id 0); the handshake's packets do not.
func (p *Proxy) readMySQL(r *bufio.Reader, w io.Writer) error {
	var pkt []byte
	for {
		pkt = append(pkt[:0], 0, 0, 0, 0)
		if _, err := io.ReadFull(r, pkt); err != nil {
			return err
		}
		n := int(pkt[0]) | int(pkt[1])<<8 | int(pkt[2])<<16
		pkt = append(pkt, make([]byte, n)...)
		if _, err := io.ReadFull(r, pkt[4:]); err != nil {
			return err
		}
		if pkt[3] == 0 && n > 0 {
			cmd := pkt[4]
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
		if _, err := w.Write(pkt); err != nil {
			return err
		}
	}
}
