package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/settle-go/settle/internal/settleenv"
	"github.com/settle-go/settle/internal/testenv"
)

// No command prints a password, whatever form of connection string it is
// given, wherever it comes from (flag or environment) and whatever goes
// wrong with it (parse error, unreachable server, refused login, HTTP
// error). Every secret here is made of pieces starting with "PW", split by
// the characters that make URLs fail to parse, so a message that shows any
// piece of one contains "PW".
func TestNoCommandPrintsAPassword(t *testing.T) {
	t.Parallel()
	jaegerErr := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream trouble", http.StatusBadGateway)
	}))
	t.Cleanup(jaegerErr.Close)
	jhost := strings.TrimPrefix(jaegerErr.URL, "http://")

	// Real servers refusing a wrong password, where they check one.
	mysqlWrong := "mysql://settle_no_such_user:PWwrong@127.0.0.1:3306/test"
	amqpWrong := "amqp://guest:PWwrong@127.0.0.1:5672/"
	testenv.Require(t, testenv.MySQLURLEnv)
	testenv.Require(t, testenv.AMQPURLEnv)

	dbForms := []string{
		"postgres://u:PWsecret@127.0.0.1:1/db?sslmode=disable",
		"postgres://127.0.0.1:1/db?user=u&password=PWsecret&sslmode=disable",
		"postgres://u:PWse/PWcret@127.0.0.1:1/db",
		"postgres://u:PWse#PWcret@127.0.0.1:1/db",
		"postgres://u:PWsecret@127.0.0.1:port/db",
		"postgresql://u:PW%zz@127.0.0.1:1/db",
		"mysql://root:PWsecret@127.0.0.1:1/test",
		"mysql://root:PWse/PWcret@127.0.0.1:1/test",
		"mysql://root:PWse?PWcret@127.0.0.1:1/test",
		"mysql://root:PWsecret@127.0.0.1:port/test",
		"mysql://root:PW%zzsecret@127.0.0.1:1/test",
		mysqlWrong,
		"root:PWsecret@tcp(127.0.0.1:1)/test",
		"root:PWse@PWcret@tcp(127.0.0.1:1)/test?parseTime=true",
		"host=127.0.0.1 port=1 user=u password=PWsecret dbname=db",
		"host=127.0.0.1 password='PWse cr\\'PWet' dbname=db",
		"host=127.0.0.1 password='PWse cret",
		"oracle://u:PWsecret@h/db",
	}
	amqpForms := []string{
		"amqp://guest:PWsecret@127.0.0.1:1/",
		"amqp://guest:PWse/PWcret@127.0.0.1:1/",
		"amqp://guest:PWse#PWcret@127.0.0.1:1/",
		"amqp://guest:PWsecret@127.0.0.1:port/",
		"amqps://guest:PW%zz@127.0.0.1:1/",
		"guest:PWsecret@127.0.0.1:5672",
		"http://guest:PWsecret@127.0.0.1:1/",
		amqpWrong,
	}
	jaegerForms := []string{
		"http://u:PWsecret@127.0.0.1:1",
		"http://u:PWse/PWcret@127.0.0.1:1",
		"http://u:PWsecret@127.0.0.1:port",
		"http://127.0.0.1:1/?token=PWtoken",
		"ftp://u:PWsecret@127.0.0.1:1",
		"u:PWsecret@127.0.0.1:16686",
		"http://u:PWsecret@" + jhost,
		"http://" + jhost + "/?access_token=PWtoken",
	}

	type run struct {
		vars map[string]string
		args []string
	}
	var runs []run
	for _, u := range dbForms {
		runs = append(runs,
			run{nil, []string{"outbox", "status", "-db", u}},
			run{nil, []string{"outbox", "status", "-db", u, "-driver", "sql"}},
			run{nil, []string{"outbox", "status", "-db", u, "-driver", "pgx"}},
			run{nil, []string{"dedupe", "prune", "-db", u, "-older-than", "30d"}},
			run{map[string]string{settleenv.PostgresURL: u}, []string{"outbox", "prune", "-older-than", "30d"}},
			run{map[string]string{settleenv.MySQLURL: u}, []string{"dedupe", "prune", "-older-than", "30d"}},
			run{nil, []string{"parked", "list", "-db", u}},
			run{nil, []string{"parked", "replay", "-all", "-yes", "-db", u, "-driver", "sql"}},
			run{map[string]string{settleenv.PostgresURL: u}, []string{"parked", "purge", "-before", "30d", "-yes"}},
			run{nil, []string{"dedupe", "show", "-handler", "h", "-key", "k", "-db", u}},
			run{map[string]string{settleenv.MySQLURL: u}, []string{"dedupe", "inflight"}},
		)
	}
	for _, u := range amqpForms {
		runs = append(runs,
			run{nil, []string{"dlq", "list", "-queue", "q", "-amqp", u}},
			run{map[string]string{envAMQPURL: u}, []string{"dlq", "replay", "-queue", "q", "-all"}},
		)
	}
	for _, u := range jaegerForms {
		runs = append(runs,
			run{nil, []string{"trace", "-jaeger", u, "-id", "abc"}},
			run{map[string]string{envJaegerURL: u}, []string{"trace", "-service", "s", "-tag", "a=b"}},
		)
	}
	for _, rn := range runs {
		r := runCmd(t.Context(), rn.vars, rn.args...)
		if r.code == exitOK {
			t.Errorf("%v (env %v): want a failure, got\n%v", rn.args, rn.vars, r)
		}
		if strings.Contains(r.stdout+r.stderr, "PW") {
			t.Errorf("%v (env %v): a password is printed:\n%v", rn.args, rn.vars, r)
		}
	}
}
