// Package sqldb is the one seam between settle and a SQL database: the
// dedupe store, the outbox and the transactional handlers of package
// pipeline all run on a [Driver], whatever the driver under it.
//
// A service names its driver once, where it opens its database:
//
//	db := sqldb.Std(sqlDB, sqldb.Postgres) // database/sql: a Driver[*sql.Tx]
//	db := sqldb.Pgx(pool)                  // pgx v5: a Driver[pgx.Tx]
//
// and passes that value to dedupe.NewSQLStore, outbox.New and
// pipeline.TxConfig. The type parameter TTx is the transaction a handler's
// function receives: *sql.Tx on database/sql, pgx.Tx on pgx. Everything
// else (the statements, and every decision settle takes from what they
// return) is written once, against Driver.
//
// Std supports PostgreSQL through pgx's database/sql driver
// (github.com/jackc/pgx/v5/stdlib), MySQL 8 and MariaDB 10.5+ through
// github.com/go-sql-driver/mysql, and SQLite through modernc.org/sqlite.
// settle registers none of these drivers: the program imports the one it
// uses. Pgx is PostgreSQL only.
//
// Another driver can be added by implementing Driver; it must pass the
// conformance suite in package sqldbtest.
package sqldb
