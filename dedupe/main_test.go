package dedupe_test

import (
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
	testenv.Main(m,
		// Watermill's own middleware.NewMapExpiringKeyRepository (the default
		// repository of middleware.Deduplicator, used here to show how it
		// loses messages) starts a cleaner goroutine on context.Background()
		// that nothing can stop. It is Watermill's leak, not settle's.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
}
