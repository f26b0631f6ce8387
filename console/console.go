package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
)

// Config configures the console. The stores are the application's own; the
// console closes none of them.
type Config[TTx any] struct {
	// Parked is the parked-message store the pages show. Required.
	Parked *parked.Store[TTx]
	// Outbox is the outbox of the same database: a replay writes its
	// copies to it, in the transaction that marks the rows replayed, and
	// the outbox page shows its status. Required.
	Outbox *outbox.Outbox[TTx]
	// Claims is the dedupe store whose claims in flight and keys the
	// claims page shows. Nil leaves the page out.
	Claims *dedupe.SQLStore[TTx]
	// Token, when set, is asked of every request: an "Authorization:
	// Bearer <token>" header, or the login form (which sets a session
	// cookie). Empty means no authentication: serve the handler only where
	// no one else can reach it. When set, at least 16 bytes.
	Token string
	// ReadOnly hides every action and refuses every POST but the login.
	ReadOnly bool
	// TraceURL is the base URL of a Jaeger UI: a message's trace id links
	// to TraceURL + "/trace/" + id. Empty shows the id without a link.
	// When set, an absolute http or https URL.
	TraceURL string
	// BasePath is the path the handler is mounted at, such as "/console":
	// it serves BasePath + "/" and below, and writes its links under it.
	// Empty (the default) serves "/". When set, it starts with "/" and
	// does not end with one.
	BasePath string
	// By is what a replay or an archive records as who asked for it.
	// Defaults to "console".
	By string
	// Logger logs the actions taken and the errors of the stores. Defaults
	// to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config[TTx]) setDefaults() {
	if c.By == "" {
		c.By = "console"
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// minTokenLen is the shortest Config.Token accepted.
const minTokenLen = 16

func (c *Config[TTx]) validate() error {
	switch {
	case c.Parked == nil:
		return errors.New("console: Config.Parked is required")
	case c.Outbox == nil:
		return errors.New("console: Config.Outbox is required")
	case c.Token != "" && len(c.Token) < minTokenLen:
		return fmt.Errorf("console: Config.Token must be at least %d bytes", minTokenLen)
	case strings.ContainsAny(c.Token, "\r\n"):
		return errors.New("console: Config.Token must not contain a line break")
	case c.BasePath != "" && (!strings.HasPrefix(c.BasePath, "/") || strings.HasSuffix(c.BasePath, "/")):
		return fmt.Errorf("console: Config.BasePath %q must start with / and not end with one", c.BasePath)
	case strings.ContainsAny(c.BasePath, "?#\"'<> "):
		return fmt.Errorf("console: Config.BasePath %q: a path only", c.BasePath)
	}
	if c.TraceURL != "" {
		u, err := url.Parse(c.TraceURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return errors.New("console: Config.TraceURL must be an absolute http or https URL")
		}
	}
	return nil
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// server is the console of one Config.
type server[TTx any] struct {
	cfg   Config[TTx]
	key   []byte // MAC key of sessions and CSRF tokens
	pages map[string]*template.Template
	mux   *http.ServeMux
	now   func() time.Time
}

// New returns the console of cfg. The handler holds no goroutine and needs
// no Close.
func New[TTx any](cfg Config[TTx]) (http.Handler, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &server[TTx]{cfg: cfg, now: time.Now}
	if cfg.Token != "" {
		// Derived from the token, so that several instances behind one
		// address accept each other's sessions, and a new token ends
		// every session.
		m := hmac.New(sha256.New, []byte("settle console session key"))
		m.Write([]byte(cfg.Token))
		s.key = m.Sum(nil)
	} else {
		s.key = make([]byte, 32)
		if _, err := rand.Read(s.key); err != nil {
			return nil, fmt.Errorf("console: key: %w", err)
		}
	}
	var err error
	if s.pages, err = parsePages(); err != nil {
		return nil, err
	}
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /static/", http.StripPrefix("/static/", staticHandler(static)))
	mux.HandleFunc("GET /login", s.loginPage)
	mux.HandleFunc("POST /login", s.login)
	mux.HandleFunc("POST /logout", s.logout)
	mux.HandleFunc("GET /{$}", s.groups)
	mux.HandleFunc("GET /messages", s.messages)
	mux.HandleFunc("GET /messages/{id}", s.message)
	mux.HandleFunc("GET /activity", s.activity)
	mux.HandleFunc("GET /outbox", s.outboxPage)
	if cfg.Claims != nil {
		mux.HandleFunc("GET /claims", s.claims)
	}
	if !cfg.ReadOnly {
		mux.HandleFunc("GET /confirm", s.confirm)
		mux.HandleFunc("POST /act", s.act)
	}
	s.mux = mux
	return s, nil
}

// ServeHTTP sets the security headers, strips BasePath, authenticates and
// checks every POST before the page's handler runs.
func (s *server[TTx]) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	// same-origin, not no-referrer: under no-referrer a browser sends
	// "Origin: null" with a form's POST, which sameOrigin must refuse.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")

	path := r.URL.Path
	if s.cfg.BasePath != "" {
		rest, ok := strings.CutPrefix(path, s.cfg.BasePath)
		switch {
		case !ok:
			http.NotFound(w, r)
			return
		case rest == "":
			http.Redirect(w, r, s.cfg.BasePath+"/", http.StatusSeeOther)
			return
		case !strings.HasPrefix(rest, "/"):
			http.NotFound(w, r)
			return
		}
		r2 := new(http.Request)
		*r2 = *r
		u := *r.URL
		u.Path, u.RawPath = rest, ""
		r2.URL = &u
		r = r2
	}

	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		r.Body = http.MaxBytesReader(w, r.Body, maxForm)
		if err := s.sameOrigin(r); err != nil {
			s.refuse(w, r, http.StatusForbidden, err.Error())
			return
		}
	}
	sess, ok := s.authenticate(r)
	public := strings.HasPrefix(r.URL.Path, "/static/") || r.URL.Path == "/login"
	if !ok && !public {
		if wantsHTML(r) && r.Method == http.MethodGet {
			http.Redirect(w, r, s.cfg.BasePath+"/login", http.StatusSeeOther)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="settle console"`)
		s.refuse(w, r, http.StatusUnauthorized, "a token is required")
		return
	}
	if s.cfg.Token == "" && sess == "" {
		// No login: a random per-browser session for the CSRF tokens.
		sess = s.newBrowserSession(w, r)
	}
	if r.Method == http.MethodPost && r.URL.Path != "/login" {
		if s.cfg.ReadOnly && r.URL.Path != "/logout" {
			s.refuse(w, r, http.StatusForbidden, "the console is read-only")
			return
		}
		if !s.validCSRF(sess, r.PostFormValue("csrf")) {
			s.refuse(w, r, http.StatusForbidden, "the form is stale or forged (bad CSRF token): reload the page")
			return
		}
	}
	r = r.WithContext(withSession(r.Context(), sess))
	s.mux.ServeHTTP(w, r)
}

// maxForm bounds the body of a POST: a thousand ids and a token.
const maxForm = 64 << 10

// wantsHTML reports whether r looks like a browser's navigation.
func wantsHTML(r *http.Request) bool {
	return r.Header.Get("Authorization") == "" && strings.Contains(r.Header.Get("Accept"), "text/html")
}

// staticHandler serves the embedded files with their types, and no
// listing.
func staticHandler(fsys fs.FS) http.Handler {
	files := http.FileServerFS(fsys)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "" || strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r)
			return
		}
		if _, err := fs.Stat(fsys, r.URL.Path); err != nil {
			// Here, not in the file server: it drops Cache-Control
			// from its errors, no-store included.
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Cache-Control", "max-age=300")
		files.ServeHTTP(w, r)
	})
}
