package sqldb_test

import (
	"os/exec"
	"strings"
	"testing"
)

// pipelineRegistersMySQL: package pipeline still imports
// go-sql-driver/mysql while it is rewritten on the sqldb seam. Set it to
// false when that import is gone.
const pipelineRegistersMySQL = true

// TestImportingSettleRegistersNoDriver builds a program that imports
// settle's packages and nothing else (testdata/nodrivers) and runs it: it
// prints sql.Drivers(), which must be empty. A driver registered by an
// import of settle is one the user did not ask for, and takes its name
// ("postgres", "mysql") from the driver the user does want.
func TestImportingSettleRegistersNoDriver(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	for _, c := range []struct{ name, tags string }{
		{"settle", ""},
		{"with-pipeline", "pipeline"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.tags == "pipeline" && pipelineRegistersMySQL {
				t.Skip("package pipeline imports go-sql-driver/mysql until its rewrite on sqldb lands")
			}
			out, err := exec.CommandContext(t.Context(), goBin, "run", "-tags="+c.tags, "./testdata/nodrivers").CombinedOutput()
			if err != nil {
				t.Fatalf("go run ./testdata/nodrivers: %v\n%s", err, out)
			}
			if drivers := strings.Fields(string(out)); len(drivers) > 0 {
				t.Fatalf("importing settle registered the database/sql drivers %q; want none (go list -deps shows who brings them)", drivers)
			}
		})
	}
}
