package gpu

import (
	"context"
	"sync"
)

// freeBuffers hands out the indices of free pinned buffers, the most
// recently returned first, so that a job's buffer is likely still in the
// CPU's caches from its last use (RATIONALE: "Why does the pinned pool
// hand out the buffer returned last?"). Tokens make takers wait.
type freeBuffers struct {
	tokens chan struct{} // one per index on the stack
	mu     sync.Mutex
	stack  []int
}

// newFreeBuffers returns a free list holding indices 0..n-1.
func newFreeBuffers(n int) *freeBuffers {
	f := &freeBuffers{tokens: make(chan struct{}, n), stack: make([]int, 0, n)}
	for i := n - 1; i >= 0; i-- {
		f.put(i)
	}
	return f
}

// take removes a free index: blocking (until ctx is done) if wait, else
// only if one is free now.
func (f *freeBuffers) take(ctx context.Context, wait bool) (int, bool, error) {
	if !wait {
		select {
		case <-f.tokens:
		default:
			return 0, false, nil
		}
	} else {
		select {
		case <-f.tokens:
		case <-ctx.Done():
			return 0, false, ctx.Err()
		}
	}
	f.mu.Lock()
	i := f.stack[len(f.stack)-1]
	f.stack = f.stack[:len(f.stack)-1]
	f.mu.Unlock()
	return i, true, nil
}

// put returns index i.
func (f *freeBuffers) put(i int) {
	f.mu.Lock()
	f.stack = append(f.stack, i)
	f.mu.Unlock()
	f.tokens <- struct{}{}
}

// free is how many indices are free now; total how many there are.
func (f *freeBuffers) free() int  { return len(f.tokens) }
func (f *freeBuffers) total() int { return cap(f.tokens) }
