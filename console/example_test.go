package console_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "modernc.org/sqlite" // the program names its driver; settle registers none

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/console"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// The console of an application's parked-message table and outbox,
// mounted under /ops/console on the application's own mux, read-only.
func Example() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "console-example")
	defer os.RemoveAll(dir)
	sqlDB, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "app.db")+"?_pragma=busy_timeout(10000)")
	if err != nil {
		panic(err)
	}
	defer sqlDB.Close()
	db := sqldb.Std(sqlDB, sqldb.SQLite)
	store, err := parked.New(db, parked.Config{})
	if err != nil {
		panic(err)
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		panic(err)
	}
	for _, ddl := range append(store.Schema(), ob.Schema()...) { // the application's migrations
		if _, err := sqlDB.ExecContext(ctx, ddl); err != nil {
			panic(err)
		}
	}
	// What the parking middleware does when a handler gives up.
	err = store.Park(ctx, settle.Parked{
		Message: message.NewMessage("m-17", []byte(`{"order": 17}`)), Outcome: settle.DeadLettered,
		Cause: errors.New("card declined"), Handler: "charge", Topic: "orders", Attempts: 5, LastFailure: time.Now(),
	})
	if err != nil {
		panic(err)
	}

	h, err := console.New(console.Config[*sql.Tx]{
		Parked: store, Outbox: ob, ReadOnly: true, BasePath: "/ops/console",
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/console/", h) // behind the application's own authentication

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ops/console/", nil))
	page := rec.Body.String()
	fmt.Println(rec.Code, strings.Contains(page, "card declined"), strings.Contains(page, "Replay"))
	// Output: 200 true false
}
