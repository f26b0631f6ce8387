package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// The cookies: the login session (with Config.Token), or a random
// per-browser value the CSRF tokens are derived from (without).
const (
	sessionCookie = "settle_console_session"
	browserCookie = "settle_console_browser"
	sessionTTL    = 12 * time.Hour
	bearerSession = "bearer" // the session of a request with the token in its header
)

// mac returns the base64 HMAC of parts under the server's key.
func (s *server[TTx]) mac(parts ...string) string {
	m := hmac.New(sha256.New, s.key)
	for _, p := range parts {
		m.Write([]byte(p))
		m.Write([]byte{0})
	}
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// tokenOK compares given with the configured token in constant time (of
// their hashes, so that the length does not show either).
func (s *server[TTx]) tokenOK(given string) bool {
	a, b := sha256.Sum256([]byte(given)), sha256.Sum256([]byte(s.cfg.Token))
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

// authenticate returns the request's session and whether the request may
// be served. Without a token every request may, and the session is the
// browser cookie's value ("" when the browser has none yet).
func (s *server[TTx]) authenticate(r *http.Request) (string, bool) {
	if s.cfg.Token == "" {
		if c, err := r.Cookie(browserCookie); err == nil && validNonce(c.Value) {
			return c.Value, true
		}
		return "", true
	}
	if h := r.Header.Get("Authorization"); h != "" {
		given, ok := strings.CutPrefix(h, "Bearer ")
		return bearerSession, ok && s.tokenOK(given)
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return "", false
	}
	return c.Value, s.validSession(c.Value)
}

// A login session is nonce.expiry.mac: it proves a login happened before
// expiry without saying anything of the token.
func (s *server[TTx]) newSession() string {
	n := nonce()
	exp := strconv.FormatInt(s.now().Add(sessionTTL).Unix(), 10)
	return n + "." + exp + "." + s.mac("session", n, exp)
}

func (s *server[TTx]) validSession(v string) bool {
	n, rest, ok := strings.Cut(v, ".")
	if !ok {
		return false
	}
	exp, sum, ok := strings.Cut(rest, ".")
	if !ok || !validNonce(n) {
		return false
	}
	if !hmac.Equal([]byte(sum), []byte(s.mac("session", n, exp))) {
		return false
	}
	e, err := strconv.ParseInt(exp, 10, 64)
	return err == nil && s.now().Unix() < e
}

func nonce() string {
	b := make([]byte, 18)
	_, _ = rand.Read(b) // never fails (crypto/rand's documented behaviour)
	return base64.RawURLEncoding.EncodeToString(b)
}

func validNonce(v string) bool {
	if len(v) != 24 {
		return false
	}
	_, err := base64.RawURLEncoding.DecodeString(v)
	return err == nil
}

// newBrowserSession sets a random per-browser cookie and returns its value.
func (s *server[TTx]) newBrowserSession(w http.ResponseWriter, r *http.Request) string {
	v := nonce()
	http.SetCookie(w, s.cookie(r, browserCookie, v, 0))
	return v
}

func (s *server[TTx]) cookie(r *http.Request, name, value string, maxAge int) *http.Cookie {
	return &http.Cookie{
		Name: name, Value: value, Path: s.cfg.BasePath + "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil,
	}
}

// csrf is the CSRF token of a session: an HMAC of it, which a page of
// another site can neither read nor compute.
func (s *server[TTx]) csrf(sess string) string { return s.mac("csrf", sess) }

func (s *server[TTx]) validCSRF(sess, given string) bool {
	return sess != "" && given != "" && hmac.Equal([]byte(given), []byte(s.csrf(sess)))
}

// sameOrigin refuses a request another site may have sent: a browser says
// so in Sec-Fetch-Site, and names the page's origin in Origin, which must
// be the host the request was sent to. A request without Origin is refused
// too (every browser sends it on a POST; a script must set it).
func (s *server[TTx]) sameOrigin(r *http.Request) error {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return errors.New("cross-site request refused (Sec-Fetch-Site: " + site + ")")
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return errors.New("a POST must carry an Origin header")
	}
	u, err := url.Parse(o)
	if err != nil || u.Host == "" || !strings.EqualFold(u.Host, r.Host) {
		return errors.New("cross-origin request refused")
	}
	return nil
}

type sessionKey struct{}

func withSession(ctx context.Context, sess string) context.Context {
	return context.WithValue(ctx, sessionKey{}, sess)
}

func sessionFrom(ctx context.Context) string {
	s, _ := ctx.Value(sessionKey{}).(string)
	return s
}

// loginPage shows the form that asks for the token.
func (s *server[TTx]) loginPage(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Token == "" {
		http.Redirect(w, r, s.cfg.BasePath+"/", http.StatusSeeOther)
		return
	}
	s.render(w, r, http.StatusOK, "login", "Log in", nil)
}

// login checks the token of the form and sets the session cookie.
func (s *server[TTx]) login(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Token == "" {
		http.Redirect(w, r, s.cfg.BasePath+"/", http.StatusSeeOther)
		return
	}
	if !s.tokenOK(r.PostFormValue("token")) {
		s.cfg.Logger.Info("console: login refused", nil)
		// A wrong token costs a second: guessing takes forever.
		select {
		case <-time.After(time.Second):
		case <-r.Context().Done():
			return
		}
		s.render(w, r, http.StatusUnauthorized, "login", "Log in", "That is not the token.")
		return
	}
	http.SetCookie(w, s.cookie(r, sessionCookie, s.newSession(), int(sessionTTL/time.Second)))
	http.Redirect(w, r, s.cfg.BasePath+"/", http.StatusSeeOther)
}

// logout ends the session of the browser: it deletes the cookie. A copy of
// the cookie stays good until its expiry (sessions are not stored).
func (s *server[TTx]) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, s.cookie(r, sessionCookie, "", -1))
	http.Redirect(w, r, s.cfg.BasePath+"/login", http.StatusSeeOther)
}
