package e2e_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) {
	// chromedp's allocator reaps the browser process in a goroutine that
	// ends shortly after the browser's context.
	testenv.Main(m, goleak.IgnoreTopFunction("os/exec.(*Cmd).Wait"))
}
