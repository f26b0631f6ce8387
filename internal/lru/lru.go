// Package lru is a bounded map that drops its least recently written entry
// when full. Every operation is O(1), so it can sit on a message's path
// under a lock without stalling it, however many entries it holds.
package lru

import (
	"container/list"
	"sync"
	"sync/atomic"
)

// Cache is safe for concurrent use.
type Cache[K comparable, V any] struct {
	mu   sync.Mutex
	max  int
	byK  map[K]*list.Element
	ord  list.List    // front: least recently written
	size atomic.Int64 // len(byK), read without the lock
}

type entry[K comparable, V any] struct {
	k K
	v V
}

// New returns a cache of at most max entries (max >= 1).
func New[K comparable, V any](max int) *Cache[K, V] {
	return &Cache[K, V]{max: max, byK: make(map[K]*list.Element)}
}

// Get returns k's value.
func (c *Cache[K, V]) Get(k K) (V, bool) {
	var zero V
	if c.size.Load() == 0 {
		return zero, false // nothing stored: the common case takes no lock
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.byK[k]; ok {
		return e.Value.(*entry[K, V]).v, true
	}
	return zero, false
}

// Update sets k's value to f(old, found) and makes it the most recently
// written entry, dropping the least recently written one if the cache is
// full. f runs under the cache's lock.
func (c *Cache[K, V]) Update(k K, f func(old V, found bool) V) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.byK[k]; ok {
		en := e.Value.(*entry[K, V])
		en.v = f(en.v, true)
		c.ord.MoveToBack(e)
		return en.v
	}
	if len(c.byK) >= c.max {
		oldest := c.ord.Front()
		c.ord.Remove(oldest)
		delete(c.byK, oldest.Value.(*entry[K, V]).k)
	}
	var zero V
	en := &entry[K, V]{k: k, v: f(zero, false)}
	c.byK[k] = c.ord.PushBack(en)
	c.size.Store(int64(len(c.byK)))
	return en.v
}

// Delete removes k.
func (c *Cache[K, V]) Delete(k K) {
	if c.size.Load() == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.byK[k]; ok {
		c.ord.Remove(e)
		delete(c.byK, k)
		c.size.Store(int64(len(c.byK)))
	}
}

// Len returns the number of entries.
func (c *Cache[K, V]) Len() int { return int(c.size.Load()) }
