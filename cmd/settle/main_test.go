package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/settle-go/settle/internal/testenv"
)

// execMainEnv, set to 1 in the environment of the test binary, makes it
// the settle command: the tests that need real processes (two replays at
// once, a replay killed) run the test binary with a command line.
const execMainEnv = "SETTLE_CMD_TEST_EXEC_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(execMainEnv) == "1" {
		main()
	}
	testenv.Main(m)
}

// result is what one run of the command produced.
type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return "exit " + string(rune('0'+r.code)) + "\nstdout:\n" + r.stdout + "\nstderr:\n" + r.stderr
}

// runCmd runs the command line with the given environment variables (none
// if vars is nil) and returns its exit code and output.
func runCmd(ctx context.Context, vars map[string]string, args ...string) result {
	var out, errOut bytes.Buffer
	code := runEnv(&env{ctx: ctx, stdout: &out, stderr: &errOut, getenv: func(k string) string { return vars[k] }}, args)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// mustRun runs the command and fails the test unless it exits with want.
func mustRun(t *testing.T, want int, args ...string) result {
	t.Helper()
	r := runCmd(t.Context(), nil, args...)
	if r.code != want {
		t.Fatalf("settle %s: want exit %d, got\n%v", strings.Join(args, " "), want, r)
	}
	return r
}
