package dedupe_test

import (
	"flag"
	"runtime"
	"strconv"
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/dedupe"

	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) {
	// A key's lock not granted in a caller's transaction on a partitioned
	// MySQL table fails it after 1 s instead of 5: the cycles the limit
	// breaks are what TxLinearizable at SERIALIZABLE makes all the time.
	dedupe.SetTxLockWait(1)
	// The package's tests wait (on the databases, on claims expiring) far
	// more than they compute: under -race its test process used under two
	// minutes of CPU in a run of nineteen. go test runs GOMAXPROCS parallel
	// tests at once, two on a 2-core CI machine, so the run took the sum of
	// its ~1000 parallel tests' times over two. Unless -parallel says
	// otherwise, twice as many run at once (three times as many overloaded
	// the databases: claims stalled past their lifetimes).
	flag.Parse()
	parallelSet := false
	flag.Visit(func(f *flag.Flag) { parallelSet = parallelSet || f.Name == "test.parallel" })
	if !parallelSet {
		_ = flag.Set("test.parallel", strconv.Itoa(2*runtime.GOMAXPROCS(0)))
	}
	testenv.Main(m,
		// Watermill's own middleware.NewMapExpiringKeyRepository (the default
		// repository of middleware.Deduplicator, used here to show how it
		// loses messages) starts a cleaner goroutine on context.Background()
		// that nothing can stop. It is Watermill's leak, not settle's.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
}
