package lru_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/lru"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The cache holds at most max entries and drops the least recently written.
func TestDropsLeastRecentlyWritten(t *testing.T) {
	t.Parallel()
	c := lru.New[int, int](3)
	inc := func(old int, _ bool) int { return old + 1 }
	for k := range 3 {
		c.Update(k, inc)
	}
	c.Update(0, inc) // 0 is now the most recent: 1 is the oldest
	c.Update(3, inc) // drops 1
	if c.Len() != 3 {
		t.Fatalf("Len = %d, want 3", c.Len())
	}
	if _, ok := c.Get(1); ok {
		t.Fatal("the least recently written entry was kept")
	}
	if v, ok := c.Get(0); !ok || v != 2 {
		t.Fatalf("Get(0) = %d, %v; want 2 (written twice)", v, ok)
	}
	c.Delete(0)
	c.Delete(42)
	if _, ok := c.Get(0); ok || c.Len() != 2 {
		t.Fatalf("after Delete: Len %d", c.Len())
	}
}
