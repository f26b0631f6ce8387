package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// settle console: the web page of package console, served on its own.

// consoleTokenEnv names the variable the console's token may come from (a
// token on the command line would show in ps).
const consoleTokenEnv = "SETTLE_CONSOLE_TOKEN"

// consoleSetup is what `settle console` builds its stores and handler
// from, whatever the database's driver.
type consoleSetup struct {
	parked parked.Config
	outbox outbox.Config
	dedupe dedupe.SQLConfig
	claims bool // show the claims page (the dedupe table exists)
	page   console.Config[struct{}]
	stderr func(msg string)
}

// consoleOn builds the stores of setup on db, checks their tables and
// returns the console's handler.
func consoleOn[TTx any](ctx context.Context, db sqldb.Driver[TTx], setup consoleSetup) (http.Handler, error) {
	ps, err := parked.New(db, setup.parked)
	if err != nil {
		return nil, err
	}
	if err := ps.Check(ctx); err != nil {
		return nil, fmt.Errorf("the parked-message table: %w", err)
	}
	ob, err := outbox.New(db, setup.outbox)
	if err != nil {
		return nil, err
	}
	if err := ob.Check(ctx); err != nil {
		return nil, fmt.Errorf("the outbox: %w", err)
	}
	var claims *dedupe.SQLStore[TTx]
	if setup.claims {
		if claims, err = dedupe.NewSQLStore(db, setup.dedupe); err != nil {
			return nil, err
		}
		if err := claims.Check(ctx); errors.Is(err, sqldb.ErrSchema) {
			setup.stderr(fmt.Sprintf("settle console: no claims page: the dedupe table %s is missing or mis-shaped (-dedupe-table names another, -dedupe-table '' leaves it out)", setup.dedupe.Table))
			claims = nil
		} else if err != nil {
			return nil, err
		}
	}
	p := setup.page
	return console.New(console.Config[TTx]{
		Parked: ps, Outbox: ob, Claims: claims,
		Token: p.Token, ReadOnly: p.ReadOnly, TraceURL: p.TraceURL, BasePath: p.BasePath, By: p.By, Logger: p.Logger,
	})
}

func runConsole(e *env, args []string) (err error) {
	const name = "console"
	fs := newFlagSet(name)
	dbURL, driver := dbFlag(fs), driverFlag(fs)
	addr := fs.String("addr", "127.0.0.1:8080", "the address to listen on; one that is not a loopback address needs a token")
	tokenFile := fs.String("token-file", "", "a file holding the access token (at least 16 bytes; default $"+consoleTokenEnv+"); with it, every request must log in or send 'Authorization: Bearer <token>'")
	readOnly := fs.Bool("read-only", false, "hide and refuse every action: look, never replay or archive")
	jaeger := fs.String("jaeger", "", "the Jaeger UI's base URL: trace ids link to <URL>/trace/<id>")
	table := fs.String("table", "settle_parked", "the parked-message table (parked.Config.Table)")
	maxReplays := fs.Int("max-replays", 3, "the loop guard: refuse to replay a message replayed this many times (parked.Config.MaxReplays)")
	topic := fs.String("topic", defaultOutboxTopic, "the outbox replays go through and whose status is shown (outbox.Config.Topic)")
	stuckAfter := fs.Duration("stuck-after", defaultStuckAfter, "a pending outbox row older than this is old")
	dedupeTable := fs.String("dedupe-table", defaultDedupeTable, "the dedupe table of the claims page; '' leaves the page out")
	by := fs.String("by", "console", "who replays and archives, as recorded on the rows")
	tlsCert := fs.String("tls-cert", "", "serve HTTPS with this certificate file (and -tls-key)")
	tlsKey := fs.String("tls-key", "", "the key file of -tls-cert")
	if err := parseFlags(e, fs, name, args); err != nil {
		return err
	}
	switch {
	case *stuckAfter <= 0:
		return usagef(fs, name, "-stuck-after must be > 0")
	case *maxReplays < 1:
		return usagef(fs, name, "-max-replays must be >= 1")
	case (*tlsCert == "") != (*tlsKey == ""):
		return usagef(fs, name, "-tls-cert and -tls-key go together")
	}
	token := e.getenv(consoleTokenEnv)
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			return usagef(fs, name, "-token-file: %v", err)
		}
		token = strings.TrimRight(string(b), "\r\n\t ")
	}
	if token != "" && len(token) < 16 {
		return usagef(fs, name, "the token must be at least 16 bytes")
	}

	// The address is checked before anything else is opened: a console
	// without a token is served on loopback only.
	ln, err := (&net.ListenConfig{}).Listen(e.ctx, "tcp", *addr)
	if err != nil {
		return usagef(fs, name, "-addr: %v", err)
	}
	defer func() {
		if ln != nil {
			_ = ln.Close()
		}
	}()
	if tcp, ok := ln.Addr().(*net.TCPAddr); !ok || !tcp.IP.IsLoopback() {
		if token == "" {
			return usagef(fs, name, "-addr %s is not a loopback address: the console refuses to listen there without a token (-token-file or $%s)", *addr, consoleTokenEnv)
		}
		if *tlsCert == "" {
			fmt.Fprintf(e.stderr, "settle console: warning: serving on %s without TLS; the token travels in clear (put it behind HTTPS, or pass -tls-cert)\n", ln.Addr())
		}
	}

	d, err := openDatabase(e, *dbURL, *driver)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	logger := watermill.NewStdLoggerWithOut(e.stderr, false, false)
	setup := consoleSetup{
		parked: parked.Config{Table: *table, MaxReplays: *maxReplays, Logger: logger},
		outbox: outbox.Config{Topic: *topic, StuckAfter: *stuckAfter},
		dedupe: dedupe.SQLConfig{Table: *dedupeTable},
		claims: *dedupeTable != "",
		page:   console.Config[struct{}]{Token: token, ReadOnly: *readOnly, TraceURL: *jaeger, By: *by, Logger: logger},
		stderr: func(msg string) { fmt.Fprintln(e.stderr, msg) },
	}
	h, err := d.console(e.ctx, setup)
	if err != nil {
		return err
	}

	if token == "" {
		h = loopbackOnly(h)
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       time.Minute,
		WriteTimeout:      5 * time.Minute, // a replay of a large group
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
	scheme := "http"
	if *tlsCert != "" {
		scheme = "https"
	}
	mode := ""
	if *readOnly {
		mode = ", read-only"
	}
	if token != "" {
		mode += ", token required"
	}
	fmt.Fprintf(e.stdout, "settle console: serving %s://%s/ (%s database%s); Ctrl-C stops it\n", scheme, ln.Addr(), d.dialect, mode)
	served := make(chan error, 1)
	l := ln
	ln = nil // the server closes it
	go func() {
		if *tlsCert != "" {
			served <- srv.ServeTLS(l, *tlsCert, *tlsKey)
		} else {
			served <- srv.Serve(l)
		}
	}()
	select {
	case err := <-served:
		return err
	case <-e.ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// loopbackOnly serves the requests addressed to a loopback name or address
// only. A console without a token listens on loopback so that no one else
// reaches it, but a web page whose host name its author then points at
// 127.0.0.1 (DNS rebinding) is of the same origin as the console for the
// browser: its requests carry its own name in Host and Origin, and it can
// read the pages and post their forms.
func loopbackOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if hh, _, err := net.SplitHostPort(host); err == nil {
			host = hh
		}
		host = strings.ToLower(strings.TrimSuffix(host, "."))
		ip := net.ParseIP(strings.Trim(host, "[]"))
		if host == "localhost" || strings.HasSuffix(host, ".localhost") || ip != nil && ip.IsLoopback() {
			h.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")
		w.Header().Set("Cache-Control", "no-store")
		http.Error(w, "settle console: without a token, only requests to localhost or a loopback address are served (this one names another host)", http.StatusMisdirectedRequest)
	})
}
