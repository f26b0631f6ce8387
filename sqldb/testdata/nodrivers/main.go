// Command nodrivers prints the database/sql drivers registered in a program
// that imports settle's packages and nothing else, one a line: none is
// registered unless the program imports a driver itself. Built with the tag
// pipeline it imports package pipeline too.
package main

import (
	"database/sql"
	"fmt"

	_ "github.com/settle-go/settle"
	_ "github.com/settle-go/settle/amqpmarshal"
	_ "github.com/settle-go/settle/amqpsub"
	_ "github.com/settle-go/settle/dedupe"
	_ "github.com/settle-go/settle/middleware"
	_ "github.com/settle-go/settle/outbox"
	_ "github.com/settle-go/settle/poison"
	_ "github.com/settle-go/settle/sqldb"
)

func main() {
	for _, d := range sql.Drivers() {
		fmt.Println(d)
	}
}
