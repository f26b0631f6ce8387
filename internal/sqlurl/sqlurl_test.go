package sqlurl_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/settle-go/settle/internal/sqlurl"
	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// Every secret in these DSNs is made of pieces that start with "PW", split by
// the characters that make a URL fail to parse, so a message that shows any
// piece of a password contains "PW".
var dsns = []struct {
	name, dsn string
	// parses says whether Parse accepts the DSN.
	parses bool
}{
	{"postgres url", "postgres://u:PWsecret@127.0.0.1:1/db?sslmode=disable", true},
	{"postgres url, password in the query", "postgres://127.0.0.1:1/db?user=u&password=PWsecret&sslmode=disable", true},
	{"postgres url, slash in the password", "postgres://u:PWse/PWcret@127.0.0.1:1/db", false},
	{"postgres url, hash in the password", "postgres://u:PWse#PWcret@127.0.0.1:1/db", false},
	{"mysql url", "mysql://root:PWsecret@127.0.0.1:1/test", true},
	{"mysql url, slash in the password", "mysql://root:PWse/PWcret@127.0.0.1:1/test", false},
	{"mysql url, question mark in the password", "mysql://root:PWse?PWcret@127.0.0.1:1/test", false},
	{"mysql url, bad port", "mysql://root:PWsecret@127.0.0.1:port/test", false},
	{"mysql url, bad escape", "mysql://root:PW%zzsecret@127.0.0.1:1/test", false},
	{"mysql url, at sign in the password", "mysql://root:PWse@PWcret@127.0.0.1:1/test", true},
	{"go-sql-driver dsn", "root:PWsecret@tcp(127.0.0.1:1)/test", false},
	{"go-sql-driver dsn, at sign in the password", "root:PWse@PWcret@tcp(127.0.0.1:1)/test?parseTime=true", false},
	{"libpq key=value", "host=127.0.0.1 port=1 user=u password=PWsecret dbname=db", false},
	{"libpq key=value, quoted", "host=127.0.0.1 password='PWse cr\\'PWet' dbname=db", false},
	{"libpq key=value, unterminated quote", "host=127.0.0.1 password='PWse cret", false},
	{"libpq key=value, spaces around =", "host=127.0.0.1 password = PWsecret dbname=db", false},
	{"libpq key=value, at sign and colon", "password=PWse:PWcr@PWet host=h", false},
	{"unknown scheme", "oracle://u:PWsecret@h/db", false},
}

func TestRedactHidesEveryForm(t *testing.T) {
	t.Parallel()
	for _, tc := range dsns {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := sqlurl.Redact(tc.dsn)
			if strings.Contains(got, "PW") {
				t.Errorf("Redact(%q) = %q: a password is left", tc.dsn, got)
			}
			if !strings.Contains(got, "xxxxx") {
				t.Errorf("Redact(%q) = %q: want xxxxx where the password was", tc.dsn, got)
			}
		})
	}
	// Nothing secret: unchanged.
	for _, u := range []string{"postgres://u@127.0.0.1:5432/db?sslmode=disable", "sqlite:///var/lib/app.db", "amqp://127.0.0.1:5672/", "http://127.0.0.1:16686"} {
		if got := sqlurl.Redact(u); got != u {
			t.Errorf("Redact(%q) = %q, want it unchanged", u, got)
		}
	}
	for in, want := range map[string]string{
		"amqp://guest:PWguest@127.0.0.1:5672/":           "amqp://guest:xxxxx@127.0.0.1:5672/",
		"http://u:PWp@jaeger:16686/?token=PWt&limit=3":   "http://u:xxxxx@jaeger:16686/?token=xxxxx&limit=3",
		"https://jaeger/api?access_token=PWt":            "https://jaeger/api?access_token=xxxxx",
		"mysql://root:PWsecret@127.0.0.1:3306/test":      "mysql://root:xxxxx@127.0.0.1:3306/test",
		"host=h password=PWsecret dbname=db":             "host=h password=xxxxx dbname=db",
		"root:PWsecret@tcp(127.0.0.1:3306)/test":         "root:xxxxx@tcp(127.0.0.1:3306)/test",
		"postgres://h/db?password=PWs&sslmode=disable":   "postgres://h/db?password=xxxxx&sslmode=disable",
		"postgres://u:PWs@h/db?sslpassword=PWk&x=1#frag": "postgres://u:xxxxx@h/db?sslpassword=xxxxx&x=1#frag",
	} {
		if got := sqlurl.Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
}

// Parse and Open never show a password, whatever form the DSN has and
// whatever part of it is wrong.
func TestErrorsNeverShowAPassword(t *testing.T) {
	t.Parallel()
	for _, tc := range dsns {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, _, _, err := sqlurl.Parse(tc.dsn)
			if (err == nil) != tc.parses {
				t.Fatalf("Parse(%q): err = %v, want parses = %v", tc.dsn, err, tc.parses)
			}
			if err != nil && strings.Contains(err.Error(), "PW") {
				t.Errorf("Parse: %v", err)
			}
			db, _, err := sqlurl.Open(tc.dsn)
			if err != nil {
				if strings.Contains(err.Error(), "PW") {
					t.Errorf("Open: %v", err)
				}
				return
			}
			defer db.Close()
			// Nothing listens on port 1: the ping fails, and its error is
			// what a caller prints.
			if err := db.PingContext(t.Context()); err == nil {
				t.Fatalf("ping of %s succeeded", sqlurl.Redact(tc.dsn))
			} else if strings.Contains(sqlurl.Scrub(err.Error(), tc.dsn), "PW") {
				t.Errorf("ping: %v", sqlurl.Scrub(err.Error(), tc.dsn))
			}
		})
	}
}

// A URL that fails to parse only because of its password says so, without
// showing it.
func TestParseSaysWhatIsWrong(t *testing.T) {
	t.Parallel()
	for dsn, want := range map[string]string{
		"mysql://root:PWse/PWcret@127.0.0.1:3306/test": `"mysql://root:xxxxx@127.0.0.1:3306/test" is not a valid URL: percent-encode`,
		"mysql://root:PWs@127.0.0.1:port/test":         `"mysql://root:xxxxx@127.0.0.1:port/test" is not a valid URL: invalid port ":port" after host`,
		"root:PWsecret@tcp(127.0.0.1:3306)/test":       `"root:xxxxx@tcp(127.0.0.1:3306)/test" is not a URL`,
		"host=h password=PWsecret":                     `"host=h password=xxxxx" is not a URL`,
	} {
		_, _, _, err := sqlurl.Parse(dsn)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%q) = %v, want %q", sqlurl.Redact(dsn), err, want)
		}
	}
}

func TestScrub(t *testing.T) {
	t.Parallel()
	dsn := "mysql://root:PWse%2Fcret@h:3306/db"
	msg := `dial: password PWse/cret and PWse%2Fcret for root`
	if got := sqlurl.Scrub(msg, dsn); strings.Contains(got, "PW") || !strings.Contains(got, "for root") {
		t.Errorf("Scrub = %q", got)
	}
}

// Whatever the password, no form shows it: URL user information, a URL
// query parameter, a go-sql-driver DSN, a libpq key=value pair bare or
// quoted.
func FuzzRedact(f *testing.F) {
	for _, s := range []string{"secret", "se/cret", "se#c?r@et", "a b", `it's`, `back\slash`, "new\nline", "%zz", "x:y", "@@@", "'", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, pw string) {
		pw = "PW" + strings.ReplaceAll(pw, "PW", "")
		bare := strings.Map(func(r rune) rune {
			if r == ' ' || r == '\t' || r == '\n' || r == '\r' || r == '\v' || r == '\f' || r == '\'' || r == '&' || r == '#' {
				return -1
			}
			return r
		}, pw)
		quoted := "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw) + "'"
		for _, dsn := range []string{
			"mysql://root:" + pw + "@127.0.0.1:3306/test",
			"postgres://u:" + pw + "@h:5432/db?sslmode=disable",
			"amqp://guest:" + pw + "@127.0.0.1:5672/",
			"http://u:" + pw + "@jaeger:16686",
			"postgres://h/db?sslmode=disable&password=" + url.QueryEscape(pw),
			"http://jaeger:16686/?token=" + bare + "&limit=1",
			"root:" + pw + "@tcp(127.0.0.1:3306)/test",
			"host=h password=" + bare + " dbname=db",
			"host=h password=" + quoted + " dbname=db",
			"host=h password = " + quoted,
		} {
			if got := sqlurl.Redact(dsn); strings.Contains(got, "PW") {
				t.Errorf("Redact(%q) = %q", dsn, got)
			}
			if _, _, _, err := sqlurl.Parse(dsn); err != nil && strings.Contains(err.Error(), "PW") {
				t.Errorf("Parse(%q): %v", dsn, err)
			}
		}
	})
}
