package sqldb_test

import (
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/settle-go/settle/internal/testenv"
	"github.com/settle-go/settle/sqldb"
	"github.com/settle-go/settle/sqldb/sqldbtest"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestConformance runs the driver suite on every driver and database.
func TestConformance(t *testing.T) {
	for _, db := range testenv.Databases() {
		t.Run("std-"+db.Name, func(t *testing.T) {
			sqldbtest.Run(t, func(t *testing.T) sqldb.Driver[*sql.Tx] {
				d := db.Open(t)
				return sqldb.Std(d.DB, sqldb.Dialect(d.Dialect))
			})
		})
	}
	t.Run("pgx-postgres", func(t *testing.T) {
		sqldbtest.Run(t, func(t *testing.T) sqldb.Driver[pgx.Tx] {
			return sqldb.Pgx(testenv.PgxPool(t))
		})
	})
}
