package fsystest

import (
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// Hold is an fsys.Injector that holds one operation, as a hung mount
// would: once armed, the first operation of the armed kind waits until
// released, then runs. It injects no error. The zero Hold holds nothing;
// it is safe for concurrent use.
type Hold struct {
	mu       sync.Mutex
	op       fsys.Op
	armed    bool
	held     bool
	released chan struct{}
	closed   bool // released is closed
}

// Arm makes the next op held until Release; arming again after a
// Release holds one more.
func (h *Hold) Arm(op fsys.Op) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.op, h.armed, h.held, h.released, h.closed = op, true, false, make(chan struct{}), false
}

// Holding reports whether the armed operation is being held (or was, and
// was released).
func (h *Hold) Holding() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held
}

// Release lets the held operation (and any later one) go on; it may be
// called more than once, and before anything is held.
func (h *Hold) Release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.armed = false
	if h.released != nil && !h.closed {
		close(h.released)
		h.closed = true
	}
}

// Inject implements fsys.Injector.
func (h *Hold) Inject(op fsys.Op, _ string) fsys.Fault {
	h.mu.Lock()
	if !h.armed || op != h.op {
		h.mu.Unlock()
		return fsys.Fault{}
	}
	h.armed, h.held = false, true
	ch := h.released
	h.mu.Unlock()
	<-ch
	return fsys.Fault{}
}
