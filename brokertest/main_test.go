package brokertest_test

import (
	"testing"

	"github.com/settle-go/settle/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }
