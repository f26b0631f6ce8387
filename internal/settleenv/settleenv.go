// Package settleenv names the environment variables that point settle's
// tests, examples and command at real services. There is one scheme, by
// service, read everywhere:
//
//	SETTLE_POSTGRES_URL  postgres://postgres@127.0.0.1:5432/test?sslmode=disable
//	SETTLE_MYSQL_URL     mysql://root@127.0.0.1:3306/test
//	SETTLE_AMQP_URL      amqp://guest:guest@127.0.0.1:5672/
//	SETTLE_NATS_URL      nats://127.0.0.1:4222 (with JetStream)
//	SETTLE_REDIS_URL     redis://127.0.0.1:6379/0
//
// The tests use every one that is set. A program that works on one database
// (an example, the settle command) takes -db, which defaults to the first
// set of SETTLE_POSTGRES_URL and SETTLE_MYSQL_URL.
package settleenv

// Environment variable names.
const (
	PostgresURL = "SETTLE_POSTGRES_URL"
	MySQLURL    = "SETTLE_MYSQL_URL"
	AMQPURL     = "SETTLE_AMQP_URL"
	NATSURL     = "SETTLE_NATS_URL"
	RedisURL    = "SETTLE_REDIS_URL"
	// RequireIntegration=1 turns a test's skip for an unset variable into a
	// failure (CI sets it).
	RequireIntegration = "SETTLE_REQUIRE_INTEGRATION"
)

// DatabaseURL returns the database a one-database program uses when -db is
// not given: SETTLE_POSTGRES_URL, else SETTLE_MYSQL_URL, with the name of the
// variable it came from; "", "" when neither is set.
func DatabaseURL(getenv func(string) string) (url, from string) {
	for _, name := range []string{PostgresURL, MySQLURL} {
		if v := getenv(name); v != "" {
			return v, name
		}
	}
	return "", ""
}

// Help is the sentence the programs' -h prints about these variables.
const Help = "-db defaults to $" + PostgresURL + ", else $" + MySQLURL + "; -amqp to $" + AMQPURL + "."
